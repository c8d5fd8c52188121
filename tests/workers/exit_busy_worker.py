"""Leaves without destroying torch.distributed's group while a gloo thread is still in a
collective's Python callback: the callback wants Python again after the main thread has
returned. Prints "exit_busy ok" per rank; what is judged is how the processes end."""

import time

import torch
import torch.distributed as dist

import sokpy

sokpy.init()
sokpy.nn.init_process_group()


def slow(future):
    time.sleep(0.3)  # lets go of the GIL; the main thread meanwhile reaches exit
    return future.value()[0]


dist.all_reduce(torch.ones(4), async_op=True).get_future().then(slow)
print("exit_busy ok", flush=True)
