"""A trainer's weights over a torch.distributed group into both pools (SGLang's
/init_weights_update_group, /update_weights_from_distributed and /destroy_weights_update_group;
router/weights.py, engine/weight_sync.py), through a router in front of a prefill and a decode
worker on tiny random checkpoint A, the trainer being pdserve's WeightSender holding HF model B:
after an update every greedy completion is HF's B token for token (the prompt's KV computed by B
on the prefill worker, extended by B on the decode worker), the version is reported by the
router, both workers' Stats and each response; a list that is not the checkpoint's is refused by
the workers with nothing changed and the group left usable; a worker that left the group refuses
the next update and the other, ready for it, is called off at once, and the sender then inits the
group again and sends once more; a wrong world_size, another backend and an update of a group
that does not exist are 400s that say what to change; a checkpoint from disk still loads after a
group's update; a destroyed group takes no update."""

from __future__ import annotations

import json
import time

import pytest

from helpers.http import post, request
from helpers.models import hf_greedy
from helpers.ports import free_ports
from helpers.weights import PROMPT, completion, served, tiny_checkpoints, weights_cluster
from pdserve.engine.weight_sync import WeightSender, WeightSyncError
from pdserve.protos.pdserve.v1 import worker_pb2

TIMEOUT_S = 60.0  # bounds on a loaded machine, never speed claims


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory, "group-ckpt")


@pytest.fixture(scope="module")
def cluster(checkpoints, one_thread):
    with weights_cluster(checkpoints["A"][0]) as out:
        yield out


def _greedy(router) -> list[int]:
    return completion(router)["choices"][0]["token_ids"]


def _info(router) -> dict:
    status, _, raw = request(router.http_address, "GET", "/weight_info")
    assert status == 200, raw
    return json.loads(raw)


def _sender(router) -> WeightSender:
    port = free_ports(1)[0]
    return WeightSender(f"http://{router.http_address}", "127.0.0.1", port, timeout_s=TIMEOUT_S)


def _post(router, path, **body) -> tuple[int, dict]:
    status, _, raw = post(router, path, body)
    return status, json.loads(raw)


def test_a_trainer_s_group_update_serves_its_weights_on_both_pools(cluster, checkpoints):
    router, stubs = cluster
    (a_dir, a_hf), (_, b_hf) = checkpoints["A"], checkpoints["B"]
    assert _greedy(router) == hf_greedy(a_hf, PROMPT, 10)
    assert _info(router)["ranks"] == 2  # one engine rank on each worker
    sender = _sender(router)
    sender.init()
    assert sender.world_size == 3 and _info(router)["groups"] == ["weight_update_group"]
    out = sender.update(b_hf.named_parameters(), version="rl-1")
    assert out["success"] is True and "2 worker(s)" in out["message"], out
    assert served(stubs) == [("group:weight_update_group#1", "rl-1")] * 2
    assert _info(router)["weight_version"] == "rl-1"
    done = completion(router)
    assert done["choices"][0]["token_ids"] == hf_greedy(b_hf, PROMPT, 10)
    assert done["pdserve"]["weight_version"] == "rl-1"
    assert not router.servicer.admission.is_paused
    # a list without one of the checkpoint's tensors: the workers refuse it before anything moves
    partial = list(a_hf.named_parameters())[1:]
    t = time.monotonic()
    with pytest.raises(WeightSyncError, match="HTTP 400.*1 missing"):
        sender.update(partial, version="bad")
    # no tensor moved and no collective was left waiting: the trainer was told at once (not
    # after the group's timeout) and its group still serves the next update
    assert time.monotonic() - t < TIMEOUT_S / 2 and sender.group is not None
    assert served(stubs) == [("group:weight_update_group#1", "rl-1")] * 2
    assert _greedy(router) == hf_greedy(b_hf, PROMPT, 10)
    assert not router.servicer.admission.is_paused
    # one worker left the group (as a restarted one would not be in it): it refuses, the other,
    # ready for the transfer, is called off at once rather than waiting out the group's timeout
    leave = worker_pb2.DestroyWeightsGroupRequest(group_name="weight_update_group")
    stubs[0].DestroyWeightsGroup(leave, timeout=TIMEOUT_S)
    sender.reinit = False
    t = time.monotonic()
    with pytest.raises(WeightSyncError, match="HTTP 409.*no weight group") as e:
        sender.update(b_hf.named_parameters(), version="half")
    assert e.value.reinit and time.monotonic() - t < TIMEOUT_S / 2
    assert served(stubs) == [("group:weight_update_group#1", "rl-1")] * 2
    assert _greedy(router) == hf_greedy(b_hf, PROMPT, 10)
    assert not router.servicer.admission.is_paused
    # by default the sender inits the group again and sends once more: A's weights, in bfloat16
    sender.reinit = True
    out = sender.update(((n, p.bfloat16()) for n, p in a_hf.named_parameters()), version="rl-2")
    assert out["success"] is True and sender.reinits == 1, out
    now = served(stubs)
    assert now[0] == now[1] and now[0][1] == "rl-2", now
    assert now[0][0].startswith("group:weight_update_group#"), now
    # weights from disk still load after a group's, and a new group's update after that
    status, out = _post(router, "/update_weights_from_disk", model_path=a_dir, weight_version="d")
    assert status == 200 and out["success"], out
    assert _greedy(router) == hf_greedy(a_hf, PROMPT, 10)
    sender = _sender(router)  # a new group of the same name replaces the old one
    sender.init()
    assert _info(router)["groups"] == ["weight_update_group"]
    out = sender.update(b_hf.named_parameters(), version="rl-3")
    assert out["success"] is True, out
    assert _greedy(router) == hf_greedy(b_hf, PROMPT, 10)
    sender.destroy()
    assert _info(router)["groups"] == []
    names = [n for n, _ in b_hf.named_parameters()]
    status, out = _post(
        router,
        "/update_weights_from_distributed",
        names=names,
        transfer_id="t1",
        dtypes=["float32"] * len(names),
        shapes=[list(p.shape) for _, p in b_hf.named_parameters()],
    )
    assert status == 400 and "no weight group 'weight_update_group'" in out["message"], out


def test_bad_group_requests_say_what_to_change(cluster):
    router, _ = cluster
    port = free_ports(1)[0]
    base = dict(master_address="127.0.0.1", master_port=port, rank_offset=1)
    status, out = _post(router, "/init_weights_update_group", **base, world_size=5)
    assert status == 400 and out["success"] is False
    assert "2 engine rank(s) now: world_size must be rank_offset + 2 = 3" in out["message"], out
    status, out = _post(router, "/init_weights_update_group", **base, world_size=3, backend="nccl")
    assert status == 400 and "run on gloo" in out["message"], out
    status, out = _post(
        router, "/init_weights_update_group", **{**base, "master_port": 0}, world_size=3
    )
    assert status == 400 and "master_port" in out["message"], out
    status, out = _post(router, "/init_weights_update_group", **base, world_size=3, rank="x")
    assert status == 400 and "unknown field(s) rank" in out["message"], out
    status, out = _post(
        router,
        "/update_weights_from_distributed",
        names=["a"],
        dtypes=["int8"],
        shapes=[[2]],
        transfer_id="t1",
    )
    assert status == 400 and "dtype 'int8'" in out["message"], out
    status, out = _post(
        router,
        "/update_weights_from_distributed",
        names=["a"],
        dtypes=["float32"],
        shapes=[[2]],
    )
    assert status == 400 and "transfer_id must be" in out["message"], out
    status, out = _post(router, "/update_weights_from_distributed", names=["a"], dtypes=["float32"])
    assert status == 400 and "shapes must be a list" in out["message"], out
    status, out = _post(router, "/destroy_weights_update_group", group_name="nope")
    assert status == 400 and "no weight group 'nope'" in out["message"], out
    assert not router.servicer.admission.is_paused
