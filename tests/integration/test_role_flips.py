"""Role flips end to end (router/flips.py, worker_common/role.py): three workers that carry both
roles, as the launcher builds them, register with a Router that checks the cluster secret; the
Admin service flips them while greedy streams run. Streams finish token-identical to the
engine's own output, moves cost no resume, the KV is all free afterwards, and every refusal
(issue #27, must-show f) leaves the roles as they were.

Real workers and the router run in this process over 127.0.0.1 (as test_router_failover_workers.py).
"""

from __future__ import annotations

import dataclasses
import threading
import time

import grpc
import pytest

from helpers.models import random_prompts
from helpers.router import MAX_MODEL_LEN, RPC_TIMEOUT
from helpers.threads import wait_until
from pdserve import cli
from pdserve.decode_worker.server import DecodeWorkerConfig
from pdserve.deploy.workers import build_worker
from pdserve.engine import LLM, SamplingParams
from pdserve.planner.live import PlannerLoop
from pdserve.planner.policy import PlannerConfig
from pdserve.protos.convert import sampling_kwargs
from pdserve.protos.pdserve.v1 import pdserve_pb2, pdserve_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.protos.security import ClusterSecurity
from pdserve.router.planner_actuator import RouterActuator
from pdserve.router.server import Router, RouterConfig

SECRET = "flip-test-secret-0123456789"
SECURITY = ClusterSecurity(SECRET)
ENGINE = dict(max_model_len=MAX_MODEL_LEN, kv_cache_memory=1 << 20, block_size=16)
LONG = pdserve_pb2.SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
STEP_DELAY_S = 0.01  # decode steps slowed so that streams are still open when a flip drains


class Deployment:
    """1 prefill + 2 decode workers (each can flip) behind a router, like `pdserve up`'s."""

    def __init__(self, model_dir):
        self.router = Router(
            RouterConfig(
                model=model_dir,
                max_model_len=MAX_MODEL_LEN,
                stats_interval_s=0.05,
                heartbeat_ms=200,
                security=SECURITY,
            )
        ).start()
        self.workers = {}
        for worker_id, role in (("w0", "prefill"), ("w1", "decode"), ("w2", "decode")):
            cfg = DecodeWorkerConfig(
                model=model_dir,
                worker_id=worker_id,
                engine_kwargs=ENGINE,
                registry_address=self.router.address,
                security=SECURITY,
                lease_ms=5000,
            )
            worker = build_worker(role, cfg, flippable=True).start()
            step = worker.loop.engine.step
            worker.loop.engine.step = lambda step=step: (time.sleep(STEP_DELAY_S), step())[1]
            self.workers[worker_id] = worker
        self.channel = SECURITY.channel(self.router.address)
        self.api = pdserve_pb2_grpc.PDServeStub(self.channel)
        self.admin = worker_pb2_grpc.AdminStub(self.channel)
        wait_until(
            lambda: self.roles() == {"w0": "prefill", "w1": "decode", "w2": "decode"},
            10,
            "registered",
        )

    def roles(self) -> dict[str, str]:
        reply = self.admin.ListWorkers(worker_pb2.ListWorkersRequest(), timeout=RPC_TIMEOUT)
        return {w.worker_id: w.role for w in reply.workers if w.state == "serving"}

    def flip(self, worker_id: str, role: str, drain_ms: int = 0):
        return self.admin.Flip(
            worker_pb2.FlipRequest(worker_id=worker_id, role=role, drain_timeout_ms=drain_ms),
            timeout=60,
        )

    def start_stream(self, prompt):
        return self.api.Generate(
            pdserve_pb2.GenerateRequest(token_ids=pdserve_pb2.TokenIds(ids=prompt), sampling=LONG),
            timeout=RPC_TIMEOUT * 3,
        )

    def all_kv_free(self) -> bool:
        for worker in self.workers.values():
            stats = worker.stats()
            if stats.num_running or stats.num_waiting or stats.num_reserved:
                return False
            if stats.num_free_blocks != stats.num_total_blocks:
                return False
        return True

    def stop(self):
        self.channel.close()
        self.router.stop()
        for worker in self.workers.values():
            worker.stop()


@pytest.fixture(scope="module")
def deployment(model_dir):
    d = Deployment(model_dir)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def greedy(model_dir):
    llm = LLM(model_dir, kv_cache_memory=1 << 20)

    def run(prompts):
        outs = llm.generate(prompts, SamplingParams(**sampling_kwargs(LONG)), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return run


def read_all(calls) -> list[list[int]]:
    """Each stream's token ids, read on a thread each (they run concurrently)."""
    out = [None] * len(calls)

    def read(i):
        out[i] = [t for r in calls[i] if r.HasField("delta") for t in r.delta.token_ids]

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def test_flips_move_streams_and_keep_them_token_identical(deployment, greedy):
    prompts = random_prompts([12, 30, 5, 21, 17, 9, 26, 14], seed=27)
    want = greedy(prompts)
    calls = [deployment.start_stream(p) for p in prompts]
    firsts = [next(c) for c in calls]  # every stream has its first token: all are decoding
    # w1 flips to prefill at once (1 ms drain bound): its open streams move to w2
    reply = deployment.flip("w1", "prefill", drain_ms=1)
    assert (reply.from_role, reply.role) == ("decode", "prefill")
    assert deployment.roles() == {"w0": "prefill", "w1": "prefill", "w2": "decode"}
    # and w0 (now one of two prefill workers) to decode, waiting for what it has
    reply0 = deployment.flip("w0", "decode")
    assert reply0.moved_streams == 0 and reply0.switch_ms < 2000
    got = read_all(calls)
    for first, tokens, expected in zip(firsts, got, want):
        assert list(first.delta.token_ids) + tokens == expected
    assert reply.moved_streams >= 1, "no stream was open on w1 when it flipped"
    # back again; the streams of this round run through the flips
    calls = [deployment.start_stream(p) for p in prompts[:4]]
    deployment.flip("w0", "prefill", drain_ms=1)
    deployment.flip("w1", "decode")
    assert deployment.roles() == {"w0": "prefill", "w1": "decode", "w2": "decode"}
    assert [
        [t for r in c if r.HasField("delta") for t in r.delta.token_ids] for c in calls
    ] == want[:4]
    wait_until(deployment.all_kv_free, 10, "KV blocks still held after the flips")
    assert deployment.workers["w1"].gate.num_switches == 2


def refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def test_bad_flips_are_refused_and_change_nothing(deployment, monkeypatch):
    before = deployment.roles()
    e = refused(lambda: deployment.flip("nobody", "decode"))
    assert e.code() == grpc.StatusCode.NOT_FOUND and "pdserve ctl roles" in e.details()
    e = refused(lambda: deployment.flip("w0", "decode"))  # the only prefill worker
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "prefill pool empty" in e.details()
    e = refused(lambda: deployment.flip("w1", "decode"))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "already serves" in e.details()
    e = refused(lambda: deployment.flip("w1", "verifier"))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "role must be one of" in e.details()
    stranger = worker_pb2_grpc.AdminStub(grpc.insecure_channel(deployment.router.address))
    for wrong in ((), (("x-pdserve-cluster-secret", "not-the-secret-at-all"),)):
        e = refused(
            lambda wrong=wrong: stranger.Flip(
                worker_pb2.FlipRequest(worker_id="w1", role="prefill"), metadata=wrong, timeout=5
            )
        )
        assert e.code() == grpc.StatusCode.UNAUTHENTICATED and "cluster secret" in e.details()
    # a flip during a flip: the first one's drain is held (its open calls counted as one) meanwhile
    flips, release = deployment.router.flips, threading.Event()
    real_count = flips.open_legs.count
    monkeypatch.setattr(
        flips.open_legs, "count", lambda w: real_count(w) or int(not release.is_set())
    )
    busy = threading.Thread(target=lambda: deployment.flip("w1", "prefill", drain_ms=60_000))
    busy.start()
    wait_until(lambda: flips._busy is not None, 5, "the first flip began")
    e = refused(lambda: deployment.flip("w2", "prefill"))
    assert e.code() == grpc.StatusCode.FAILED_PRECONDITION and "under way" in e.details()
    release.set()
    busy.join(60)
    assert deployment.roles()["w1"] == "prefill"
    deployment.flip("w1", "decode")
    assert deployment.roles() == before
    assert all(w.gate.state == "serving" for w in deployment.workers.values())


def test_pdserve_ctl_lists_roles_flips_and_refuses(deployment, tmp_path, capsys):
    secret = tmp_path / "secret"
    secret.write_text(SECRET + "\n")
    base = ["ctl", "--router", deployment.router.address, "--secret-file", str(secret)]
    assert cli.main(base + ["roles"]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert [r.split("\t")[:3] for r in rows] == [
        ["w0", "prefill", "serving"],
        ["w1", "decode", "serving"],
        ["w2", "decode", "serving"],
    ]
    assert cli.main(base + ["flip", "w2", "prefill"]) == 0
    assert "w2: decode -> prefill (drain" in capsys.readouterr().out
    assert deployment.roles()["w2"] == "prefill"
    assert cli.main(base + ["flip", "w1", "prefill"]) == 1  # the last decode worker
    assert "decode pool empty" in capsys.readouterr().err
    assert cli.main(base + ["flip", "w2", "decode"]) == 0
    capsys.readouterr()
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-cluster-secret-0000")
    assert cli.main(base[:3] + ["--secret-file", str(wrong), "roles"]) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert cli.main(base[:3] + ["--secret-file", str(tmp_path / "none"), "roles"]) == 2
    assert "cannot read the secret file" in capsys.readouterr().err


def test_the_planner_loop_flips_the_least_loaded_worker_and_counts_its_decisions(
    deployment, monkeypatch
):
    """PlannerLoop (planner/live.py, router/planner_actuator.py) over the live deployment, its signals forced: TTFT
    pressed while TPOT has room twice in a row flips a decode worker to prefill, through Flips."""
    r = deployment.router
    loop = PlannerLoop(
        PlannerConfig(ttft_s=1.0, tpot_s=0.1, sustain=2, cooldown_s=0),
        RouterActuator(r.pool, r.flips, r.servicer.legs, r.metrics.recent),
    )
    live = loop.signals()
    assert (live.prefill_workers, live.decode_workers) == (1, 2)
    # (no demand estimate: one flip, whatever the tests before left in the window)
    pressed = dataclasses.replace(
        live, ttft_p90_s=3.0, tpot_p90_s=0.01, itl_p50_s=None, prompt_tokens_per_s=0.0
    )
    monkeypatch.setattr(loop, "signals", lambda: dataclasses.replace(pressed, now=time.monotonic()))
    loop.step()
    assert deployment.roles() == {"w0": "prefill", "w1": "decode", "w2": "decode"}
    loop.step()
    roles = deployment.roles()
    assert sorted(roles.values()) == ["decode", "prefill", "prefill"], roles
    flipped = next(w for w in ("w1", "w2") if roles[w] == "prefill")
    assert loop.last[1].action == "flip_to_prefill" and not loop.planner.flipping
    deployment.flip(flipped, "decode")
    assert deployment.roles() == {"w0": "prefill", "w1": "decode", "w2": "decode"}
