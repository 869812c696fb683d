"""A Python rank in a toma::dist job: speaks the store protocol of toma's module docs ("Keys").

Run by tests/dist/main.rs (`a_python_rank_speaks_the_store_protocol`) beside Rust ranks, with
torchrun's variables. Prints one RESULT line, as the Rust ranks do.
"""
import os
from datetime import timedelta

import torch.distributed as dist

rank = int(os.environ["RANK"])
world = int(os.environ["WORLD_SIZE"])
restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
store = dist.TCPStore(
    os.environ["MASTER_ADDR"],
    int(os.environ["MASTER_PORT"]),
    is_master=False,
    timeout=timedelta(seconds=60),
    wait_for_workers=False,
)
rounds = {}


def exchange(namespace, values, message=""):
    """One round: publish ours, wait for every rank's, read them all, drop our previous key."""
    r = rounds.get(namespace, 0)
    rounds[namespace] = r + 1
    base = f"toma/{restart}/{namespace}/{r}/"
    payload = ",".join(str(v) for v in values) + (";" + message if message else "")
    store.set(base + str(rank), payload)
    keys = [base + str(i) for i in range(world)]
    store.wait(keys, timedelta(seconds=60))
    raw = store.multi_get(keys)
    if r > 0:
        store.delete_key(f"toma/{restart}/{namespace}/{r - 1}/{rank}")
    out = []
    for value in raw:
        numbers = value.decode().split(";", 1)[0]
        out.append([int(n) for n in numbers.split(",")] if numbers else [])
    return out


def all_reduce(namespace, op, values):
    columns = zip(*exchange(namespace, values))
    return [op(column) for column in columns]


exchange("join", [world])
mx = all_reduce("probe", max, [rank * 10, -rank])
total = all_reduce("probe", sum, [rank + 1])
exchange("end", [])
# Leaving: the rank that hosts the store waits until every rank has.
store.add(f"toma/{restart}/exit", 1)
print(f"RESULT max={mx[0]},{mx[1]} sum={total[0]}", flush=True)
