"""train.transformers: the hf stack's facts that changed between transformers releases, with the bytes
derived by hand from each release's source (checks/stacks.py transformers_facts cites the lines).

Shapes: Llama-3.2-1B (h 2048, 16 layers, vocab 128256, tied: 1,235,814,400 parameters, the embedding
128256 x 2048 = 262,668,288 the largest tensor); Llama-2-7B (32 layers, head_dim 128,
max_position_embeddings 4096); Mistral-7B (32 layers, head_dim 128, max_position_embeddings 32768).
"""

import pytest

from podkit.checks import activations as A
from podkit.checks.memory import estimate, trainable_params

P_1B, EMBED_1B = 1_235_814_400, 128_256 * 2048
V_3 = 128_256


def part(est, label, phase):
    return sum(p.bytes for p in est.phase_parts[phase] if p.label.startswith(label))


# ---- 1. the Trainer's default AdamW kernel ---------------------------------------------------------


@pytest.mark.parametrize("transformers,torch,impl,step_bytes", [
    # adamw_hf until 4.32 (transformers' own AdamW loop), priced as torch's for-loop: 2 x the embedding, fp32.
    ("4.31.0", "", "for-loop", 2 * EMBED_1B * 4),
    # adamw_torch = torch.optim.AdamW, foreach on CUDA: _foreach_sqrt of every fp32 exp_avg_sq at once.
    ("4.32.0", "", "foreach", P_1B * 4),
    ("4.53.3", "2.9.0", "foreach", P_1B * 4),
    ("4.54.0", "2.7.1", "foreach", P_1B * 4),  # fused only from torch 2.8
    ("4.54.0", "2.8.0", "fused", 0),          # adamw_torch_fused: updates in place
    ("4.57.1", "", "fused", 0),
    ("", "", "fused", 0),                     # a current transformers with a current torch
])
def test_trainer_default_adamw_kernel_follows_transformers_and_torch(job, transformers, torch, impl, step_bytes):
    j = job(train=f"stack = 'hf'\ntransformers = '{transformers}'\ntorch = '{torch}'")
    assert trainable_params(j) == P_1B
    assert j.facts.optimizer_impl == impl
    assert part(estimate(j), "step temporaries", "step") == step_bytes
    # An explicit kernel (a script that builds its own torch.optim.AdamW) wins over the Trainer's default.
    j = job(train=f"stack = 'hf'\ntransformers = '{transformers}'\ntorch = '{torch}'\noptimizer_impl = 'foreach'")
    assert part(estimate(j), "step temporaries", "step") == P_1B * 4


# ---- 2. rotary cos/sin tables kept as buffers by every attention layer ------------------------------


LLAMA2_7B_TABLES = 32 * 2 * 4096 * 128  # layers x (cos, sin) x max_position_embeddings x head_dim


@pytest.mark.parametrize("transformers,kept", [
    ("4.31.0", True), ("4.37.2", True),   # cos_cached / sin_cached from _set_cos_sin_cache
    ("4.38.0", False), ("4.38.1", False),  # 4.38.0-4.38.1 compute cos/sin per forward, no table
    ("4.38.2", True), ("4.39.3", True), ("4.40.2", True),  # _cos_cached / _sin_cached "for BC"
    ("4.41.0", False), ("", False),
])
def test_llama_rotary_buffers_by_release(job, transformers, kept):
    lora = job(model='preset = "llama-2-7b"', train=f"stack = 'hf'\nlora_rank = 8\ntransformers = '{transformers}'")
    # A LoRA base is loaded in the compute dtype (bf16): torch.get_default_dtype() while it is built.
    assert part(estimate(lora), "rotary cos/sin", "step") == (LLAMA2_7B_TABLES * 2 if kept else 0)
    if kept:
        # A full fine-tune under bf16-mixed keeps fp32 weights, so it was built in fp32: 4 B per value.
        full = job(model='preset = "llama-2-7b"', train=f"stack = 'hf'\ntransformers = '{transformers}'")
        assert part(estimate(full), "rotary cos/sin", "step") == LLAMA2_7B_TABLES * 4


def test_rotary_buffers_are_on_every_gpu_and_other_families_end_elsewhere(job):
    # FSDP1 flattens parameters only: each rank keeps every layer's tables whole.
    sharded = job(model='preset = "llama-2-7b"',
                  train="stack = 'hf'\nlora_rank = 8\nprecision = 'bf16'\ntransformers = '4.39.3'",
                  cluster="gpu = 'A100-80GB'\ngpus_per_node = 2\nsharding = 'zero3'")
    assert part(estimate(sharded), "rotary cos/sin", "step") == LLAMA2_7B_TABLES * 2
    # Mistral kept its cos_cached / sin_cached through 4.41.x, 32768 positions long.
    for transformers, kept in (("4.41.2", True), ("4.42.0", False)):
        j = job(model='preset = "mistral-7b"', train=f"stack = 'hf'\nlora_rank = 8\ntransformers = '{transformers}'")
        assert part(estimate(j), "rotary cos/sin", "step") == (32 * 2 * 32768 * 128 * 2 if kept else 0)
    # Mixtral kept them through 4.47.x: its config.json's 32768 positions (the preset carries them).
    for transformers, kept in (("4.47.1", True), ("4.48.0", False)):
        j = job(model='preset = "mixtral-8x7b"', train=f"stack = 'hf'\nlora_rank = 8\ntransformers = '{transformers}'")
        assert part(estimate(j), "rotary cos/sin", "step") == (32 * 2 * 32768 * 128 * 2 if kept else 0)
    # Qwen2 kept them through 4.44.x; the Qwen2.5 base configs give 131072 positions at 7B, 32768 at 3B
    # (28 and 36 layers, head_dim 128).
    for preset, layers, positions in (("qwen2.5-7b", 28, 131072), ("qwen2.5-3b", 36, 32768)):
        for transformers, kept in (("4.44.2", True), ("4.45.0", False)):
            j = job(model=f'preset = "{preset}"', train=f"stack = 'hf'\nlora_rank = 8\ntransformers = '{transformers}'")
            assert part(estimate(j), "rotary cos/sin", "step") == (layers * 2 * positions * 128 * 2 if kept else 0)
    # Explicit dimensions size them by model.max_position_embeddings (the peft doc's Llama-2-70B).
    j = job(model="hidden = 8192\nlayers = 80\nheads = 64\nkv_heads = 8\nffn = 28672\nvocab = 32000\n"
                  "max_position_embeddings = 4096",
            train="stack = 'hf'\nlora_rank = 8\nprecision = 'bf16'\ntransformers = '4.39.0'")
    assert part(estimate(j), "rotary cos/sin", "step") == 80 * 2 * 4096 * 128 * 2


# ---- 3. the loss path ---------------------------------------------------------------------------------


@pytest.mark.parametrize("transformers,loss,forward,per_logit", [
    # <= 4.45: the model's fp32 logits (the 16-bit ones freed by .float()) + the shifted fp32 copy +
    # log-softmax = 12 B; backward 3 x 4 B: the same peak as >= 4.49's max(2 + 4 + 4, 3 x 4) = 12.
    ("4.39.3", "fp32-upcast", 10, 12),
    # 4.46-4.48 ForCausalLMLoss: the 16-bit logits (still in `outputs`) 2 + fp32 copy 4 + shifted copy 4
    # + log-softmax 4 = 14 B at the forward peak.
    ("4.46.0", "fp32-upcast-shifted", 14, 14),
    ("4.48.3", "fp32-upcast-shifted", 14, 14),
    ("4.49.0", "fp32-upcast", 10, 12),  # labels padded, no logits copy
    ("", "fp32-upcast", 10, 12),
])
def test_loss_path_follows_the_release(job, transformers, loss, forward, per_logit):
    j = job(model='preset = "llama-3.2-3b"', train=f"stack = 'hf'\nprecision = 'bf16'\nmicro_batch = 2\n"
                                                   f"seq_len = 512\ntransformers = '{transformers}'")
    assert j.facts.loss == loss and j.facts.loss_upcast
    lb = A.loss_bytes(j, 512)
    assert (lb.forward, lb.backward, lb.kept, lb.hole) == (forward, 12, 0, 2)
    assert part(estimate(j), "loss:", "forward-end") == per_logit * V_3 * 1024


V_GPT2 = 50257


@pytest.mark.parametrize("transformers,loss", [("4.45.2", "compute-shifted"), ("4.48.1", "compute-shifted"),
                                               ("4.49.0", "fp32-upcast"), ("", "fp32-upcast")])
def test_gpt2_keeps_its_own_loss_through_4_48(job, transformers, loss):
    """GPT2LMHeadModel shifts a .contiguous() copy of its compute-dtype logits and runs CrossEntropyLoss on it
    until 4.49 moves it to ForCausalLMLoss; cross_entropy upcasts only under autocast, which accelerate's
    native AMP puts around the model whenever the Trainer's precision is mixed."""
    def facts(precision, micro_batch=4, stack="hf"):
        j = job(model='preset = "gpt2-124m"', train=f"stack = '{stack}'\nprecision = '{precision}'\n"
                                                    f"micro_batch = {micro_batch}\nseq_len = 1024\n"
                                                    f"transformers = '{transformers}'")
        lb = A.loss_bytes(j, 1024)
        return j, (lb.forward, lb.backward, lb.kept, lb.hole)

    mixed, lb = facts("bf16-mixed")
    assert mixed.facts.loss == loss
    if loss != "compute-shifted":
        return
    # CUDA runs it as nll_loss(log_softmax(x, dim, x.dtype)): bf16 logits 2 + their shifted bf16 copy 2 + bf16
    # log-softmax 2 + nll_loss's fp32 cast 4 = 10; then native AMP's fp32 copy of the logits beside the logits
    # and both saved tensors: 2 + 2 + 4 + 4 = 12. Backward: both saved, and nll_loss's fp32 gradient: 2 + 4 + 4.
    assert mixed.facts.loss_upcast and lb == (12, 10, 0, 0)
    assert part(estimate(mixed), "loss:", "forward-end") == 12 * V_GPT2 * 4 * 1024
    assert facts("bf16-mixed", micro_batch=1)[1] == (12, 10, 0, 0)  # the copy is not what peaks
    # Pure bf16 (no native AMP): the loss stays in bf16: 2 + 2 + 2, backward 3 x 2.
    pure, lb = facts("bf16")
    assert not pure.facts.loss_upcast and lb == (6, 6, 0, 0)
    # DeepSpeed's engine runs no autocast even at a mixed precision.
    assert facts("bf16-mixed", stack="deepspeed")[1] == (6, 6, 0, 0)


def test_one_sequence_shifts_without_a_copy(job):
    """At micro-batch 1, logits[..., :-1, :] of a (1, s, vocab) tensor is contiguous, so `.contiguous()` returns
    it: 4.46-4.48's loss holds 2 + 4 + 4 B per logit in forward, and its peak is backward's 3 x 4 B."""
    import torch

    logits = torch.zeros(1, 8, 16)
    assert logits[..., :-1, :].contiguous().data_ptr() == logits.data_ptr()
    assert torch.zeros(2, 8, 16)[..., :-1, :].contiguous().data_ptr() != logits.data_ptr()
    j = job(model='preset = "llama-3.2-3b"',
            train="stack = 'hf'\nprecision = 'bf16'\nmicro_batch = 1\nseq_len = 1024\ntransformers = '4.48.3'")
    lb = A.loss_bytes(j, 1024)
    assert (lb.forward, lb.backward) == (2 + 4 + 4, 12)
    assert part(estimate(j), "loss:", "forward-end") == 12 * V_3 * 1024


# ---- 4. reentrant checkpointing by default before transformers 5 --------------------------------------


def test_checkpointing_is_reentrant_before_transformers_5(job):
    H, QD, F, L = 2048, 2048, 8192, 16

    def acts(transformers):
        j = job(train="stack = 'hf'\nlora_rank = 16\nbase_quant = 'nf4'\nprecision = 'bf16'\nseq_len = 512\n"
                      f"checkpointing = 'full'\nbitsandbytes = '0.43.0'\ntransformers = '{transformers}'")
        return j.facts.reentrant, part(estimate(j), "saved activations", "forward-end")

    # gradient_checkpointing_enable: use_reentrant True through 4.57, False from 5.0.0. bitsandbytes
    # < 0.43.2 keeps each 4-bit matmul's input in ctx until backward, which only a reentrant
    # checkpoint's no_grad forward avoids: q/k/v's normed input (h), o_proj's input (q_dim), gate/up's
    # (h) and down's (ffn), bf16, for every layer.
    (old, kept_old), (new, kept_new) = acts("4.57.1"), acts("5.0.0")
    assert old and not new
    assert kept_new - kept_old == L * 512 * (2 * H + QD + F) * 2


# ---- 5. the deepspeed stack runs the same transformers model --------------------------------------------


def test_deepspeed_stack_follows_the_release_but_steps_with_deepspeeds_optimizer(job):
    """The HF Trainer under DeepSpeed runs the transformers model, loss and gradient_checkpointing of the
    job's release, as the hf stack does; the optimizer step runs inside DeepSpeed's wrapper on its flat
    partitions, so the Trainer's default AdamW kernel (foreach before 4.54) does not apply."""
    def ds(transformers, **extra):
        rest = "".join(f"\n{k} = '{v}'" for k, v in extra.items())
        return job(model="hidden = 8192\nlayers = 80\nheads = 64\nkv_heads = 8\nffn = 28672\nvocab = 32000\n"
                         "max_position_embeddings = 4096",
                   train=f"stack = 'deepspeed'\nlora_rank = 8\nprecision = 'bf16-mixed'\nmicro_batch = 2\nseq_len = 512\n"
                         f"checkpointing = 'full'\ntransformers = '{transformers}'{rest}",
                   cluster="gpu = 'A100-80GB'\ngpus_per_node = 2\nsharding = 'zero3'")

    old, shifted, current = ds("4.39.0"), ds("4.47.1"), ds("")
    assert (old.facts.reentrant, shifted.facts.reentrant, current.facts.reentrant) == (True, True, False)
    assert (old.facts.loss, shifted.facts.loss, current.facts.loss) == ("fp32-upcast", "fp32-upcast-shifted",
                                                                        "fp32-upcast")
    assert {j.facts.optimizer_impl for j in (old, shifted, current)} == {"fused"}
    # 4.39's Llama tables, whole on both ranks (ZeRO-3 partitions parameters, not buffers), in the 16-bit
    # dtype DeepSpeed's bf16 engine holds the module in: 80 x 2 x 4096 x 128 x 2 B.
    assert part(estimate(old), "rotary cos/sin", "step") == 80 * 2 * 4096 * 128 * 2
    assert part(estimate(shifted), "rotary cos/sin", "step") == 0
    # 4.46-4.48's loss keeps the 16-bit logits beside the fp32 copy and its shifted copy: 14 B per logit
    # at the forward peak (of two sequences: one shifts without a copy), against a current release's 12 (its
    # backward's 3 x 4 B; test 3 above).
    assert part(estimate(shifted), "loss:", "forward-end") - part(estimate(current), "loss:", "forward-end") \
        == (14 - 12) * 32000 * 1024


# ---- 6. SDPA's contiguous q, k and v ----------------------------------------------------------------------


@pytest.mark.parametrize("transformers,v_kept", [
    ("4.47.1", 3 * 3072),  # Phi3SdpaAttention: .contiguous() only on CUDA with a mask (l.621-623)
    ("4.48.3", 3072), ("4.55.4", 3072),  # sdpa_attention_forward `value = value.contiguous()` (4.55.4 l.72-74)
    ("4.56.2", 3 * 3072), ("", 3 * 3072),  # no copy: the saved v is a view that keeps the whole qkv output
])
def test_phi3s_v_is_a_view_of_the_qkv_output_only_where_sdpa_gets_it_uncopied(job, transformers, v_kept):
    """Review 2026-11-26: 65e7959 priced the v Phi-3's SDPA saves as a view keeping the whole fused qkv output (so in
    transformers 5.23, measured). transformers 4.48.0-4.55.x make q, k and v contiguous before the kernel
    (integrations/sdpa_attention.py), which copies v out of the qkv output; the kernel keeps that copy and the qkv
    output dies with the attention's forward: Phi-3 mini (MHA, q_dim = kv_dim = 3072) keeps 3072 bf16 values per
    token for v, not 3 x 3072."""
    def saved(t):
        j = job(model='preset = "phi-3-mini"', train=f"stack = 'hf'\nlora_rank = 8\nlora_targets = 'all-linear'\n"
                                                    f"precision = 'bf16'\nseq_len = 1024\ntransformers = '{t}'")
        return sum(A.saved_per_token(A.block_facts(j), "none").values())

    assert saved(transformers) - saved("") == (v_kept - 3 * 3072) * 2
