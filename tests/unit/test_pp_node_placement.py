"""Pipeline stages on several Ray nodes (issue #53), without Ray running: the placement strategy a
pipelined pool's replica asks for and the pools.<pool>.stage_placement key (deploy/placement.py),
the resource check that lets stages fill several nodes (deploy/prechecks.py), the checks made
before Ray starts (the KV cache sized per stage, pp refused on GPUs: deploy/config/checks.py),
the start table's per-stage nodes, the refusal of ranks on another host than rank 0's while rank
0 maps their KV files (deploy/rank_actors.py), and a launcher whose check fails leaving no follower
(engine/tp.py). The real two-node cluster: tests/e2e/test_ray_nodes.py."""

from __future__ import annotations

import pytest

from pdserve.deploy import launcher
from pdserve.deploy.config.checks import fit_problems, placement_problems
from pdserve.deploy.config.load import ConfigError, validate_config
from pdserve.deploy.placement import pg_options
from pdserve.deploy.prechecks import DeployError
from pdserve.deploy.start_table import row

SMOL = {  # SmolLM2-135M: a float32 block of 16 tokens is 737,280 bytes over its 30 layers
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "head_dim": 64,
    "max_position_embeddings": 8192,
}


def prefill(**kwargs):
    """A deployment of the prefill pool `kwargs` and a decode pool of 0.1 CPU."""
    decode = {"resources": {"num_cpus": 0.1}}
    return validate_config({"pools": {"prefill": kwargs, "decode": decode}})


# ---- the placement group ---------------------------------------------------------------------------
def test_one_stage_packs_strictly_and_stages_may_spread():
    assert pg_options(prefill(tp=2).pools.prefill)["strategy"] == "STRICT_PACK"
    staged = prefill(tp=2, pp=2, resources={"num_cpus": 0.5}).pools.prefill
    assert pg_options(staged) == {"bundles": [{"CPU": 0.5}] * 4, "strategy": "PACK"}
    spread = prefill(pp=3, stage_placement="spread").pools.prefill
    assert pg_options(spread)["strategy"] == "STRICT_SPREAD"
    assert prefill().pools.prefill.stage_placement == "pack"


def test_spread_with_tp_and_unknown_placements_are_refused():
    with pytest.raises(ConfigError, match="stage_placement 'spread' puts every rank on a node of"):
        prefill(tp=2, pp=2, stage_placement="spread")
    with pytest.raises(ConfigError, match="pools.prefill.stage_placement: Input should be 'pack'"):
        prefill(pp=2, stage_placement="strict")


# ---- Ray's resources -------------------------------------------------------------------------------
def test_stages_may_fill_several_nodes_under_pack():
    two = [{"CPU": 1.0}, {"CPU": 1.0}]  # no node holds two ranks of 0.6 CPU
    launcher.check_resources(prefill(pp=2, resources={"num_cpus": 0.6}), {"CPU": 2.0}, two, False)
    three = prefill(pp=3, resources={"num_cpus": 0.6})  # 1.8 CPU of 2, but 2 bundles fit
    with pytest.raises(DeployError) as e:
        launcher.check_resources(three, {"CPU": 2.0}, two, local=False)
    assert str(e.value) == (
        "pools.prefill: one replica needs tp 1 x pp 3 ranks of 0.6 CPU; the Ray nodes hold 2 "
        "such bundles between them: lower pools.prefill.tp, .pp or .resources, or add nodes"
    )


def test_spread_needs_a_node_per_stage():
    cfg = prefill(pp=2, stage_placement="spread", resources={"num_cpus": 1})
    launcher.check_resources(cfg, {"CPU": 4.0}, [{"CPU": 2.0}, {"CPU": 2.0}], local=False)
    with pytest.raises(DeployError) as e:  # enough CPUs, one node
        launcher.check_resources(cfg, {"CPU": 4.0}, [{"CPU": 4.0}], local=True)
    assert str(e.value) == (
        "pools.prefill: stage_placement 'spread' needs 2 nodes that each hold 1 CPU (tp 1 x pp 2 "
        "ranks of 1 CPU, one per node); the Ray cluster has 1: add nodes, set "
        "pools.prefill.stage_placement to 'pack', or lower pools.prefill.pp"
    )


# ---- before Ray starts -----------------------------------------------------------------------------
def test_pp_on_gpus_is_refused_before_anything_starts():
    cfg = prefill(pp=2, resources={"num_gpus": 1})
    assert placement_problems(cfg) == [
        "pools.prefill.pp: 2 on GPUs is refused today (pipeline stages have run only on CPUs, "
        "over gloo; their CUDA/NCCL path has never run on a GPU): set pools.prefill.pp to 1, or "
        "run the pool on CPUs (resources.num_gpus: 0)"
    ]
    assert placement_problems(prefill(pp=2)) == []


def test_each_stage_sizes_its_kv_by_its_own_layers():
    """512 float32 blocks of all 30 layers do not fit: 511 do not hold one 8192-token sequence
    at pp 1, but at pp 2 the same bytes hold twice the blocks of 15 layers."""
    pool = {"kv_cache_memory": 737_280 * 511, "max_model_len": 8192}
    one = fit_problems(prefill(**pool), SMOL)
    assert len(one) == 1 and "holds 511 KV blocks of 16 tokens, but" in one[0]
    assert fit_problems(prefill(pp=2, **pool), SMOL) == []
    small = {"kv_cache_memory": 737_280 * 200, "max_model_len": 8192}
    three = fit_problems(prefill(pp=3, **small), SMOL)  # 10 layers a stage: 600 blocks
    assert three == []
    two = fit_problems(prefill(pp=2, **small), SMOL)  # 15 layers a stage: 400 blocks < 512
    assert len(two) == 1
    assert "holds 400 KV blocks of 16 tokens (each rank: 15 layers of a stage), but" in two[0]


# ---- the start table -------------------------------------------------------------------------------
def test_the_start_table_names_the_nodes_of_later_stages():
    base = {"node_ip": "10.0.0.1", "node_id": "aaaaaaaa1111", "dtype": "float32", "pp": 2}
    assert row(base)[2] == "10.0.0.1 (aaaaaaaa)"
    ranks = [
        {"rank": 0, "stage": 0, "node_ip": "10.0.0.1", "node_id": "aaaaaaaa1111"},
        {"rank": 1, "stage": 1, "node_ip": "10.0.0.2", "node_id": "bbbbbbbb2222"},
    ]
    assert row({**base, "ranks": ranks})[2] == "10.0.0.1 (aaaaaaaa), stage 1: 10.0.0.2 (bbbbbbbb)"
    same = [dict(r, node_ip="10.0.0.1", node_id="aaaaaaaa1111") for r in ranks]
    assert row({**base, "ranks": same})[2] == "10.0.0.1 (aaaaaaaa)"


# ---- the rank launcher -----------------------------------------------------------------------------
class _Handle:
    def __init__(self, rank, ip):
        self.rank, self.where, self.killed = rank, {"node_ip": ip}, False

    def kill(self):
        self.killed = True


def test_ranks_on_another_host_are_refused_while_rank_0_maps_their_kv(monkeypatch):
    import ray

    from pdserve.deploy.rank_actors import RayRanks

    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda: "10.0.0.1")
    ranks = RayRanks("prefill-0", pg=object())
    here, away = _Handle(1, "10.0.0.1"), _Handle(1, "10.0.0.2")
    ranks.check([here], [None, "/dev/shm/a"])  # one host: the files are shared
    ranks.check([away], [None, None])  # no files to map: any host
    # a later pipeline stage (no file: it pushes its own KV) may sit elsewhere
    ranks.check([away], ["/dev/shm/a", None])
    with pytest.raises(RuntimeError) as e:
        ranks.check([away], ["/dev/shm/a", "/dev/shm/b"])
    assert str(e.value).startswith(
        "prefill-0: its ranks landed on other hosts than rank 0's (10.0.0.1: rank 1 on "
        "10.0.0.2), but rank 0 maps the KV pools of its own stage's tensor-parallel ranks"
    )


def test_a_launcher_whose_check_fails_leaves_no_follower(monkeypatch):
    from pdserve.engine import tp
    from pdserve.engine.config import EngineConfig

    handles = [_Handle(1, "x"), _Handle(2, "y")]

    class Refusing:
        def rendezvous_host(self):
            return "10.0.0.1"

        def launch(self, config, model_config, model_dir, paths, host, port):
            assert (host, port) == ("10.0.0.1", 4242)
            return handles

        def check(self, procs, paths):
            raise RuntimeError("no")

    class Store:  # rank 0's store, on the port the kernel gave it
        port = 4242

    monkeypatch.setattr(tp, "_master_store", lambda host, world: Store())
    tp.use_launcher(Refusing())
    try:
        with pytest.raises(RuntimeError, match="no"):
            tp.TPGroup.start(
                EngineConfig(model="m", pipeline_parallel_size=3), None, "", [None] * 3
            )
    finally:
        tp.use_launcher(None)
    assert all(h.killed for h in handles)
    assert isinstance(tp.current_launcher(), tp.LocalRanks)


def test_each_stage_holds_its_share_of_the_weights():
    """SmolLM2-135M's 134.5M parameters: 3,540,096 a decoder layer, 28,312,128 in the tied
    embedding and LM head and the final norm, which the first stage holds."""
    from pdserve.deploy.prechecks import stage_weight_bytes

    hf = {**SMOL, "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True}
    whole = stage_weight_bytes(hf, tp=1, pp=1, itemsize=1)
    assert whole == [30 * 3_540_096 + 28_312_128] == [134_515_008]
    halves = stage_weight_bytes(hf, tp=1, pp=2, itemsize=4)
    assert halves == [4 * (15 * 3_540_096 + 28_312_128), 4 * 15 * 3_540_096]
    assert sum(halves) == 4 * whole[0]
    assert stage_weight_bytes(hf, tp=2, pp=2, itemsize=4) == [h // 2 for h in halves]


@pytest.mark.parametrize(
    "keys, billions",
    [
        (  # gpt-oss-20b: 32 experts a layer, untied head
            dict(
                hidden_size=2880, num_hidden_layers=24, num_attention_heads=64,
                num_key_value_heads=8, head_dim=64, intermediate_size=2880,
                num_local_experts=32, vocab_size=201088,
            ),
            20.9,
        ),
        (  # Mixtral 8x7B
            dict(
                hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, intermediate_size=14336, num_local_experts=8,
                vocab_size=32000,
            ),
            46.7,
        ),
        (  # Qwen3-30B-A3B: 128 experts of 768 (intermediate_size is a dense layer's)
            dict(
                hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                moe_intermediate_size=768, num_experts=128, vocab_size=151936,
            ),
            30.5,
        ),
    ],
)  # fmt: skip
def test_every_expert_is_counted(keys, billions):
    """A mixture of experts holds all its experts: the estimate gives the published totals
    (a lower bound that counted one dense MLP let `up` start workers that could not load)."""
    from pdserve.deploy.prechecks import stage_weight_bytes

    assert round(stage_weight_bytes(keys, tp=1, pp=1, itemsize=1)[0] / 1e9, 1) == billions


def test_dense_layers_of_a_mixture_of_experts_count_as_dense():
    from pdserve.deploy.prechecks import mlp_params

    deepseek = dict(
        hidden_size=8, intermediate_size=40, moe_intermediate_size=4, n_routed_experts=6,
        n_shared_experts=2, first_k_dense_replace=1,
    )  # fmt: skip
    assert mlp_params(deepseek, 0) == 3 * 8 * 40
    assert mlp_params(deepseek, 1) == 3 * 8 * 4 * 6 + 3 * 8 * 8 + 8 * 6
    glm_flash = dict(deepseek, mlp_layer_types=["sparse", "dense"])
    assert [mlp_params(glm_flash, i) for i in (0, 1)] == [mlp_params(deepseek, 1), 3 * 8 * 40]
    qwen2_moe = dict(
        hidden_size=8, intermediate_size=40, moe_intermediate_size=4, num_experts=6,
        shared_expert_intermediate_size=12, decoder_sparse_step=2, mlp_only_layers=[3],
    )  # fmt: skip
    assert [mlp_params(qwen2_moe, i) == 3 * 8 * 40 for i in range(4)] == [True, False, True, True]


def test_workers_that_need_more_memory_than_is_free_are_refused():
    from pdserve.deploy.prechecks import memory_problems

    hf = {**SMOL, "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True}
    kv = 64 << 20
    cfg = validate_config(
        {
            "dtype": "float32",
            "pools": {
                "prefill": {"pp": 2, "kv_cache_memory": kv},
                "decode": {"kv_cache_memory": kv},
            },
        }
    )
    need = 2 * 4 * 134_515_008 + 3 * kv  # the weights twice (both pools), three KV caches
    assert memory_problems(cfg, hf, need) == []
    (problem,) = memory_problems(cfg, hf, need - 1)
    assert problem.startswith(
        "pools: the workers' weights and KV caches need at least 1.19 GiB (decode 1 x tp 1 x "
        "0.56 GiB; prefill 1 x tp 1 x (stage 0: 0.37 GiB, stage 1: 0.26 GiB a rank); each rank "
        "loads its stage's layers in the model's dtype"
    ), problem


@pytest.mark.parametrize("quantization", ["int4", "int8", "auto"])
def test_a_quantized_pool_is_counted_as_it_loads(quantization):
    """A worker allocates and loads every dense weight in float32 before int8 or int4 packs it:
    what it holds while it starts, the bound, is the float32 model's."""
    from pdserve.deploy.prechecks import memory_problems

    hf = {**SMOL, "intermediate_size": 1536, "vocab_size": 49152, "tie_word_embeddings": True}
    kv = 64 << 20
    pools = {"prefill": {"kv_cache_memory": kv}, "decode": {"kv_cache_memory": kv}}
    cfg = validate_config({"quantization": quantization, "pools": pools})
    need = 2 * 4 * 134_515_008 + 2 * kv
    assert memory_problems(cfg, hf, need) == []
    assert memory_problems(cfg, hf, need - 1)
