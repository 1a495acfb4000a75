"""Issue 58 item 3: one model name re-pointed and deleted while requests load it.

Concurrent clients create, copy over, delete and generate with one name through a real
server, store and llama-server children. A campaign found children that escaped the
scheduler (started while a stop found no process to stop: running, not in ``ps``, under no
cap) and generates answered 500 "llama-server exited while loading (killed by SIGTERM)",
the manager's own stop of a load worded as an engine crash. Once everything has settled,
every llama-server child of the server is one the scheduler has loaded, and no answer was a
500.
"""

from __future__ import annotations

import asyncio
import collections
import random

import pytest
from srvutil import OPTS, llama_children, wait_until

pytestmark = [pytest.mark.engine, pytest.mark.slow]

NAME = "race"
WORKERS = 12
ROUNDS = 30


async def create_from_tiny(http):
    return await http.post("api/create", json={"model": NAME, "from": "tiny", "stream": False})


async def create_from_other(http):
    return await http.post("api/create", json={"model": NAME, "from": "other", "stream": False})


async def copy_tiny(http):
    return await http.post("api/copy", json={"source": "tiny", "destination": NAME})


async def copy_other(http):
    return await http.post("api/copy", json={"source": "other", "destination": NAME})


async def delete(http):
    return await http.request("DELETE", "api/delete", json={"model": NAME})


async def generate(http):
    return await http.post("api/generate", json={"model": NAME, "prompt": "Hi", "stream": False,
                                                  "options": {**OPTS, "num_predict": 2}})


# generates weigh most: the race is a load under way when the name moves
OPERATIONS = [create_from_tiny, create_from_other, copy_tiny, copy_other, delete, generate, generate, generate]


async def test_a_name_raced_by_create_copy_delete_and_generate_leaves_no_child_behind(http, ext):
    statuses: collections.Counter = collections.Counter()
    failures: list[tuple[str, int, str]] = []

    async def client(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(ROUNDS):
            op = rng.choice(OPERATIONS)
            r = await op(http)
            statuses[(op.__name__, r.status_code)] += 1
            if r.status_code >= 500 or r.status_code not in (200, 404, 409):
                failures.append((op.__name__, r.status_code, r.text[:400]))

    await asyncio.wait_for(asyncio.gather(*(client(i) for i in range(WORKERS))), 900)  # (a deadlock bound)
    assert not failures, (failures[:5], dict(statuses))
    assert statuses[("generate", 200)] > 0, dict(statuses)

    sched = ext.scheduler
    assert sched is not None

    def settled() -> bool:
        return (sched.pending == 0 and sched.in_flight == 0 and not sched._retiring and not sched._stopping
                and all(lo.state == "ready" for lo in sched.loaded.values()))

    await wait_until(settled, timeout=60)
    tracked = {p["pid"] for p in sched.ps()}
    children = set(llama_children())
    assert children <= tracked, f"llama-server children the scheduler does not know: {sorted(children - tracked)}"
    assert len(children) <= sched.max_loaded(0)
