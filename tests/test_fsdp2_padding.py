"""FSDP2 stores each rank's shard padded to whole rows of dim 0: against torch's own fully_shard, and by hand.

fully_shard splits dim 0 of every parameter into world chunks of ceil(dim0 / world) rows and pads every
rank's shard to chunk 0's size (torch/distributed/fsdp/_fully_shard/_fsdp_param.py _init_sharded_param). A
transformers 5.x expert bank's dim 0 is the expert count, so with more GPUs than experts each GPU keeps a
whole expert: Mixtral's 8 experts over 16 GPUs are twice an even share.
"""

import json

import pytest

from podkit.checks.memory import estimate, fsdp2_stored

# A tiny Mixtral as transformers 5.23 builds it: experts as 3-D banks (MixtralExperts gate_up_proj
# (experts, 2 x ffn, hidden), down_proj (experts, hidden, ffn)), a bare (experts, hidden) router weight.
TINY_MIXTRAL = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
    "num_local_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
    "rope_theta": 1e6, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


def _job(job, config_dir, world):
    return job(model=f'hf_config = "{config_dir / "config.json"}"',
               train="stack = 'hf'\ntransformers = '5.23.0'",
               cluster=f"gpus_per_node = {world}\nsharding = 'zero3'\nfsdp_version = 2")


@pytest.fixture
def fake_world():
    """A fake process group (torch's fake_pg: collectives are no-ops) of a given size, rank 0, torn down after."""
    dist = pytest.importorskip("torch.distributed")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def start(size):
        dist.init_process_group("fake", rank=0, world_size=size, store=FakeStore())

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [3, 8, 16])  # experts not a multiple of it, a multiple, fewer experts than GPUs
def test_fsdp2_stored_is_what_fully_shard_keeps_on_rank_0(job, tmp_path, fake_world, world):
    import torch
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    (tmp_path / "config.json").write_text(json.dumps(TINY_MIXTRAL))
    j = _job(job, tmp_path, world)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    # podkit lists the same model: every parameter counted.
    assert j.shape.params == sum(p.numel() for p in model.parameters())
    fake_world(world)
    for layer in model.model.layers:  # accelerate's and torchtitan's wrap: each decoder layer, then the root
        fully_shard(layer)
    fully_shard(model)
    # Rank 0's shards are the padded ones (chunk 0 is always whole); each is a DTensor's local tensor.
    kept = sum(p.to_local().numel() for p in model.parameters())
    assert sum(g.total for g in fsdp2_stored(j, j.shape.param_groups())) == kept * world
    if world == 8:
        assert kept * world == j.shape.params  # 8 experts over 8 GPUs and every other dim 0 divides: no padding
    else:
        assert kept * world > j.shape.params


def test_mixtral_over_16_gpus_keeps_one_expert_per_gpu_by_hand(job):
    # Mixtral-8x7B (h 4096, 32 layers, 32 heads and 8 kv heads of 128, 8 experts of ffn 14336, vocab 32000,
    # untied), transformers 5: rank 0's values under FSDP2 over 16 GPUs.
    j = job(model='preset = "mixtral-8x7b"', train="stack = 'hf'\ntransformers = '5.0.0'\nprecision = 'bf16-mixed'\n"
            "checkpointing = 'full'", cluster="gpus_per_node = 8\nnodes = 2\nsharding = 'zero3'\nfsdp_version = 2")
    per_layer = (2 * 4096 * 4096 + 2 * 1024 * 4096) // 16 + 2 * 4096 // 16  # q, o, k, v, two norms: an even share
    per_layer += 1 * 4096  # the router's (8, 4096) weight: ceil(8 / 16) = 1 row
    per_layer += 1 * (2 * 14336 * 4096 + 4096 * 14336)  # one whole expert of each bank
    root = (2 * 32000 * 4096 + 4096) // 16  # embedding, head, final norm
    rank = 32 * per_layer + root
    assert rank == 5_737_562_368  # vs 46,702,792,704 / 16 = 2,918,924,544 spread evenly
    est = estimate(j)
    # bf16-mixed: fp32 parameters, gradients and AdamW's two fp32 states, each its rank's padded shard.
    assert est.term("params", "step") == rank * 4
    assert est.term("grads", "step") == rank * 4
    assert est.term("optimizer", "step") == rank * 8  # transformers 5's adamw_torch_fused: no step temporaries
    # Gathered for compute in bf16: the all-gather output of a block is world x its padded shard, so the
    # two gathered blocks hold 16 expert slots per bank (the real 8 are views of it), plus the root.
    [gathered] = [p.bytes for p in est.phase_parts["backward"] if p.label == "unsharded weights being used"]
    assert gathered == (2 * 16 * per_layer + 2 * 32000 * 4096 + 4096) * 2
    assert any("8 experts over 16 GPUs leave 1 on each GPU" in n for n in est.notes)


def test_even_expert_shares_are_not_padded(job):
    # 8 experts over 8 GPUs: each GPU keeps exactly one; the estimate is the even share and says nothing.
    j = job(model='preset = "mixtral-8x7b"', train="stack = 'hf'\ntransformers = '5.0.0'",
            cluster="gpus_per_node = 8\nsharding = 'zero3'\nfsdp_version = 2")
    est = estimate(j)
    assert est.term("params", "step") == 46_702_792_704 // 8 * 4
    assert not any("expert bank" in n for n in est.notes)


def test_deepspeed_partitions_experts_evenly(job):
    # DeepSpeed ZeRO-3 partitions each parameter flat (ceil(numel / world) values), not by rows: over 16 GPUs
    # Mixtral's experts are an even share and no FSDP2 note is given.
    j = job(model='preset = "mixtral-8x7b"', train="stack = 'deepspeed'\ntransformers = '5.0.0'",
            cluster="gpus_per_node = 8\nnodes = 2\nsharding = 'zero3'")
    est = estimate(j)
    assert est.term("optimizer", "step") == 46_702_792_704 * 12 // 16  # fp32 master + Adam's two states, spread evenly
    assert not any("expert bank" in n for n in est.notes)


def test_for_loop_adamw_temporaries_are_the_local_piece(job):
    # torch.optim's for-loop AdamW (_single_tensor_adamw: denom = (exp_avg_sq.sqrt() / bc2).add_(eps)) runs on each
    # DTensor's local tensor: two temporaries of the largest local piece, one whole expert of a gate_up bank
    # (2 x 14336 x 4096 values) when 8 experts are spread over 16 GPUs; fp32 states under bf16-mixed.
    j = job(model='preset = "mixtral-8x7b"', train="stack = 'hf'\ntransformers = '5.0.0'\noptimizer_impl = 'for-loop'",
            cluster="gpus_per_node = 8\nnodes = 2\nsharding = 'zero3'\nfsdp_version = 2")
    [step] = [p.bytes for p in estimate(j).phase_parts["step"] if p.label == "step temporaries"]
    assert step == 2 * (2 * 14336 * 4096) * 4


def test_one_expert_bank_is_whole_on_every_rank(fake_world):
    # torchtitan < 0.2.0's shared experts: GroupedExperts(num_experts=1), w1 / w3 (1, dim, hidden) and w2 (1, hidden,
    # dim) Parameters (models/deepseek_v3/model/moe.py at d655e167). fully_shard's dim-0 chunks of a size-1 dim over 8
    # ranks are the whole tensor on rank 0 and padding of the same size on ranks 1-7.
    import torch
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    shared = nn.Module()
    shared.w1, shared.w3, shared.w2 = (nn.Parameter(torch.empty(s, device="meta")) for s in
                                       [(1, 64, 96), (1, 64, 96), (1, 96, 64)])
    fake_world(8)
    fully_shard(shared)
    assert [p.to_local().numel() for p in shared.parameters()] == [64 * 96] * 3


def _deepseek_v2_lite(job, torchtitan=""):
    return job(model='preset = "deepseek-v2-lite"',
               train="stack = 'torchtitan'\nprecision = 'bf16-mixed'\ncheckpointing = 'full'\nseq_len = 2048\n"
               + (f"torchtitan = '{torchtitan}'" if torchtitan else ""),
               cluster="gpus_per_node = 8\nsharding = 'zero3'")


def test_torchtitan_before_0_2_keeps_whole_shared_experts_on_every_rank_by_hand(job):
    # DeepSeek-V2-Lite: 26 MoE layers, each with 2 shared experts of moe_intermediate_size 1408 -> one
    # (2048 -> 2816) gated MLP, 3 x 2048 x 2816 = 17,301,504 values. torchtitan 0.2.0 builds it as a FeedForward
    # of nn.Linear (rows of 2816 / 2048 split evenly over 8 GPUs); before it as a 1-expert bank that every GPU
    # stores whole (padded on ranks 1-7), rank 0 with its AdamW states.
    shared, layers, world = 3 * 2048 * 2816, 26, 8
    extra = layers * (shared - shared // world)  # values per rank beyond the even share
    now, before = estimate(_deepseek_v2_lite(job)), estimate(_deepseek_v2_lite(job, "0.1.0"))
    assert before.term("params", "step") - now.term("params", "step") == extra * 4  # fp32 masters
    assert before.term("grads", "step") - now.term("grads", "step") == extra * 4  # fp32 reduce-scatter output
    assert before.term("optimizer", "step") - now.term("optimizer", "step") == extra * 8  # exp_avg, exp_avg_sq
    assert estimate(_deepseek_v2_lite(job, "0.2.0")).term("params", "step") == now.term("params", "step")
