"""An abort storm on a pipelined prefill worker (issue 53, must-show b's cancellation at CI
scale): a prefill worker in 2 pipeline stages, its prompts prefilled in chunks so that rank 0
runs ahead of the last stage, pushes KV over shm, in place into the decode worker's pool, from
both stages. Streams cancelled by their clients at random moments, many of them during their
hand-offs, leave every other stream identical to a clean run (its logprobs too: KV written by a
cancelled request's stage into blocks handed on shows there first), and all KV free on both sides.
The two orders this rests on: the router aborts the prefill worker before it frees the decode
side (router/legs.py), and rank 0 answers that abort only once the later stages pushed what they
had of the request (engine/engine_core.py `abort`)."""

from __future__ import annotations

import random

from helpers.chaos import SecureCluster, abort_storm, wait_until
from helpers.models import random_prompts


def test_abort_storm_on_a_pipelined_prefill_over_shm(tiny_models):
    model_dir, _ = tiny_models("llama-gqa")
    staged = dict(pipeline_parallel_size=2, max_num_batched_tokens=16, max_num_seqs=4)
    cluster = SecureCluster(model_dir, kv_backend="shm", prefill_engine=staged)
    try:
        assert cluster.prefill.loop.engine.tp.pipelined
        prompts = random_prompts([random.Random(i).randint(20, 60) for i in range(8)], seed=5)
        abort_storm(cluster.api, prompts)
        wait_until(cluster.kv_all_free, 20, "all KV free after the storm")
        assert cluster.prefill.loop.engine.tp.reports_pending == 0
    finally:
        cluster.stop()
