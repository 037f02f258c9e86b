"""Weights from a trainer's group (engine/weight_sync.py) into LLMEngine: a trainer thread, rank
0, sends checkpoint B's tensors (HF's named_parameters) to an engine started on A, at TP 1 and
across TP 2's ranks (each rank a member of the group), and the engine then answers as HF's B
does, token for token; bfloat16 tensors load too. Refused before anything moves: an unknown
group, a list that is not the checkpoint's tensors, a running request. A trainer that sends
another list than the request described, or goes away mid-update, fails the update on every
rank and the engine still answers as A; the group is closed and a new one works."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from helpers.engine import KV, greedy
from helpers.models import hf_greedy, random_prompts
from helpers.ports import free_ports
from helpers.threads import assert_no_leaks
from helpers.weights import tiny_checkpoints
from pdserve.engine import LLM
from pdserve.engine.errors import WeightUpdateRefused
from pdserve.engine.weight_sync import WeightSyncError, open_group, send, specs_of

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_TOKENS = 12
TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{name: (model_dir, HF model)}: A and B share every shape."""
    return tiny_checkpoints(tmp_path_factory, "group-weights")


def _answers(llm, prompts) -> list[list[int]]:
    return [
        o.outputs[0].token_ids for o in llm.generate(prompts, greedy(MAX_TOKENS), use_tqdm=False)
    ]


def _hf(model, prompts) -> list[list[int]]:
    return [hf_greedy(model, p, MAX_TOKENS) for p in prompts]


class Trainer:
    """Rank 0 on a thread: opens the group, then sends what it is given."""

    def __init__(self, world_size: int):
        self.port = free_ports(1)[0]
        self.group = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._open, args=(world_size,), daemon=True)
        self._thread.start()

    def _open(self, world_size):
        try:
            self.group = open_group("127.0.0.1", self.port, 0, world_size, TIMEOUT_S)
        except BaseException as e:
            self.error = e

    def opened(self):
        self._thread.join(TIMEOUT_S)
        assert self.group is not None, self.error

    def send(self, tensors, specs, transfer_id="t") -> threading.Thread:
        result = []

        def run():
            try:
                result.append(send(self.group, tensors, specs, transfer_id))
            except BaseException as e:
                result.append(e)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.result = result
        return thread


def _tensors(hf, dtype=None):
    items = [(n, p.detach()) for n, p in hf.named_parameters()]
    if dtype is not None:
        items = [(n, t.to(dtype)) for n, t in items]
    names = [n for n, _ in items]
    dtypes = [str(t.dtype).removeprefix("torch.") for _, t in items]
    shapes = [list(t.shape) for _, t in items]
    return names, dtypes, shapes, [t for _, t in items]


def _join(llm, trainer, world_size, name="g") -> None:
    ranks = llm.engine.join_weights_group(name, "127.0.0.1", trainer.port, 1, world_size, TIMEOUT_S)
    assert ranks == world_size - 1
    trainer.opened()


@pytest.mark.parametrize("tp", [1, 2])
def test_a_group_update_answers_as_the_trainer_s_weights(checkpoints, tp):
    (a_dir, a_hf), (_, b_hf) = checkpoints["A"], checkpoints["B"]
    prompts = random_prompts([5, 40, 70], seed=3)
    llm = LLM(a_dir, tensor_parallel_size=tp, kv_cache_memory=KV, block_size=16)
    try:
        want_a, want_b = _hf(a_hf, prompts), _hf(b_hf, prompts)
        assert want_a != want_b
        assert _answers(llm, prompts) == want_a
        trainer = Trainer(1 + tp)
        _join(llm, trainer, 1 + tp)
        names, dtypes, shapes, tensors = _tensors(b_hf)
        sender = trainer.send(tensors, specs_of(names, dtypes, shapes), "t1")
        llm.engine.receive_weights("g", names, dtypes, shapes, "t1", version="7", source="b")
        sender.join(TIMEOUT_S)
        assert sender.result == [True]
        assert (llm.engine.weights_dir, llm.engine.weight_version) == ("b", "7")
        assert _answers(llm, prompts) == want_b  # the longer prompts were cached under A
        # the same group again, in bfloat16 this time: A's weights rounded to bf16 load
        names, dtypes, shapes, tensors = _tensors(a_hf, torch.bfloat16)
        sender = trainer.send(tensors, specs_of(names, dtypes, shapes), "t2")
        llm.engine.receive_weights("g", names, dtypes, shapes, "t2", version="8")
        sender.join(TIMEOUT_S)
        assert sender.result == [True]
        rounded = {n: t.float() for n, t in zip(names, tensors, strict=True)}
        a_hf_bf16 = type(a_hf)(a_hf.config).eval()
        a_hf_bf16.load_state_dict(rounded, strict=False)
        a_hf_bf16.tie_weights()
        assert _answers(llm, prompts) == _hf(a_hf_bf16, prompts)
        assert llm.engine.leave_weights_group("g")
        assert not llm.engine.leave_weights_group("g")
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()


def test_refusals_move_nothing(checkpoints):
    (a_dir, a_hf), (_, b_hf) = checkpoints["A"], checkpoints["B"]
    prompts = random_prompts([9, 30], seed=5)
    llm = LLM(a_dir, kv_cache_memory=KV, block_size=16)
    try:
        names, dtypes, shapes, _ = _tensors(b_hf)
        with pytest.raises(WeightUpdateRefused, match="no weight group 'g'") as e:
            llm.engine.receive_weights("g", names, dtypes, shapes, "t")
        assert e.value.precondition
        trainer = Trainer(2)
        _join(llm, trainer, 2)
        with pytest.raises(WeightUpdateRefused, match="1 missing"):
            llm.engine.receive_weights("g", names[1:], dtypes[1:], shapes[1:], "t")
        with pytest.raises(WeightUpdateRefused, match="1 unknown"):
            llm.engine.receive_weights(
                "g", [*names, "x.weight"], [*dtypes, "float32"], [*shapes, [2]], "t"
            )
        bad = [list(s) for s in shapes]
        bad[0][0] += 1
        with pytest.raises(WeightUpdateRefused, match="shape"):
            llm.engine.receive_weights("g", names, dtypes, bad, "t")
        with pytest.raises(WeightUpdateRefused, match="dtype 'int8'"):
            llm.engine.receive_weights("g", names, ["int8"] * len(names), shapes, "t")
        llm.engine.add_request("running", prompts[0], greedy(MAX_TOKENS))
        with pytest.raises(WeightUpdateRefused, match="pause first"):
            llm.engine.receive_weights("g", names, dtypes, shapes, "t")
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        with pytest.raises(WeightUpdateRefused, match="transfer_id must be"):
            llm.engine.receive_weights("g", names, dtypes, shapes, "not/an/id")
        with pytest.raises(WeightUpdateRefused, match="do not fit a group of world_size 2"):
            llm.engine.join_weights_group("h", "127.0.0.1", trainer.port, 2, 2)
        assert llm.engine.weight_version == "" and llm.engine.weights_dir == a_dir
        assert _answers(llm, prompts) == _hf(a_hf, prompts)
    finally:
        llm.shutdown()


def test_a_trainer_that_sends_another_list_or_leaves_changes_nothing(checkpoints):
    (a_dir, a_hf), (_, b_hf) = checkpoints["A"], checkpoints["B"]
    prompts = random_prompts([9, 30], seed=6)
    llm = LLM(a_dir, kv_cache_memory=KV, block_size=16)
    try:
        trainer = Trainer(2)
        _join(llm, trainer, 2)
        names, dtypes, shapes, tensors = _tensors(b_hf)
        # the trainer sends bfloat16 where the request said float32: refused by the header
        other = specs_of(names, ["bfloat16"] * len(names), shapes)
        sender = trainer.send([t.bfloat16() for t in tensors], other, "x1")
        with pytest.raises(WeightSyncError, match="not the ones the update request listed"):
            llm.engine.receive_weights("g", names, dtypes, shapes, "x1", version="x")
        sender.join(TIMEOUT_S)
        assert sender.result == [False]
        assert _answers(llm, prompts) == _hf(a_hf, prompts)
        # the group was closed by the failure: an update on it fails at once, a new one works
        with pytest.raises(WeightSyncError, match="closed"):
            llm.engine.receive_weights("g", names, dtypes, shapes, "x2")
        trainer = Trainer(2)
        _join(llm, trainer, 2)
        # a trainer that goes away after the header: every rank fails, nothing loaded
        specs = specs_of(names, dtypes, shapes)

        def header_then_leave():
            from pdserve.engine.weight_sync import digest, nbytes

            while not trainer.group.ctl.check(trainer.group.ready_keys("y1")):
                time.sleep(0.01)
            assert trainer.group.decide("y1", go=True)
            head = torch.tensor([digest(specs), sum(nbytes(s) for s in specs)])
            trainer.group.broadcast(head, 0).wait()
            flag = torch.tensor([1])
            trainer.group.allreduce([flag]).wait()
            trainer.group = None  # drops the group: its connections close

        leaver = threading.Thread(target=header_then_leave, daemon=True)
        leaver.start()
        with pytest.raises(WeightSyncError):
            llm.engine.receive_weights("g", names, dtypes, shapes, "y1", version="y")
        leaver.join(TIMEOUT_S)
        assert llm.engine.weight_version == ""
        assert _answers(llm, prompts) == _hf(a_hf, prompts)
        assert_no_leaks(llm.engine)
    finally:
        llm.shutdown()


def test_a_transfer_nobody_starts_or_called_off_leaves_the_group_usable(checkpoints):
    """Ranks ready for a transfer the trainer never starts give up after the group's timeout,
    and one called off (a worker elsewhere refused) at once; neither enters a collective, so the
    next transfer on the same group runs."""
    (a_dir, _), (_, b_hf) = checkpoints["A"], checkpoints["B"]
    prompts = random_prompts([9, 30], seed=8)
    llm = LLM(a_dir, kv_cache_memory=KV, block_size=16)
    try:
        trainer = Trainer(2)
        ranks = llm.engine.join_weights_group("g", "127.0.0.1", trainer.port, 1, 2, 3.0)
        assert ranks == 1
        trainer.opened()
        names, dtypes, shapes, tensors = _tensors(b_hf)
        t = time.monotonic()
        with pytest.raises(WeightSyncError, match="did not start it within 3 s"):
            llm.engine.receive_weights("g", names, dtypes, shapes, "n1")
        assert time.monotonic() - t < 3.0 + TIMEOUT_S / 4
        threading.Timer(0.3, llm.engine.call_off_transfer, args=("g", "n2")).start()
        with pytest.raises(WeightSyncError, match="called off"):
            llm.engine.receive_weights("g", names, dtypes, shapes, "n2")
        sender = trainer.send(tensors, specs_of(names, dtypes, shapes), "n3")
        llm.engine.receive_weights("g", names, dtypes, shapes, "n3", version="b")
        sender.join(TIMEOUT_S)
        assert sender.result == [True]
        assert _answers(llm, prompts) == _hf(b_hf, prompts)
    finally:
        llm.shutdown()
