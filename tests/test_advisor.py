from podkit.checks.advisor import HEADROOM, advise
from podkit.checks.memory import estimate


def test_suggestions_fit_and_keep_the_effective_batch(job):
    j = job(model='preset = "llama-3.1-8b"', train="micro_batch = 4\ngrad_accum = 4\nseq_len = 4096",
            cluster="gpu = 'A100-80GB'\ngpus_per_node = 8\nhost_ram_gb = 1000")
    assert not estimate(j).fits
    suggestions = advise(j)
    assert 1 <= len(suggestions) <= 4
    for s in suggestions:
        assert s.estimate.total <= s.estimate.capacity * (1 - HEADROOM)
        changed = dict((name, new) for name, _, new in s.changes)
        mb = changed.get("train.micro_batch", 4)
        accum = changed.get("train.grad_accum", 4)
        assert mb * accum == 16  # the effective batch survives
    slowdowns = [s.slowdown for s in suggestions if not s.caveat]
    assert slowdowns == sorted(slowdowns)


def test_changes_to_what_is_trained_come_last(job):
    # Full fine-tune of 8B on 24 GB: ZeRO-Offload fits (bf16 weights on the GPU), LoRA too.
    j = job(model='preset = "llama-3.1-8b"', train="micro_batch = 2\nseq_len = 2048", cluster="gpu = 'A10G'")
    suggestions = advise(j)
    assert ("cluster.offload", "none", "optimizer") in suggestions[0].changes and not suggestions[0].caveat
    caveats = [bool(s.caveat) for s in suggestions]
    assert caveats == sorted(caveats)  # everything that changes what is trained comes after
    # With 64 GB of host RAM the offload (16 B/param = 128 GB) is refused: only LoRA remains.
    small_host = job(model='preset = "llama-3.1-8b"', train="micro_batch = 2\nseq_len = 2048",
                     cluster="gpu = 'A10G'\nhost_ram_gb = 64")
    assert all("LoRA" in s.caveat for s in advise(small_host))


def test_sequence_length_only_as_last_resort(job):
    j = job(model='preset = "llama-3.1-8b"', train="micro_batch = 1\nseq_len = 65536\nlora_rank = 16\nbase_quant = 'nf4'",
            cluster="gpu = 'A10G'")
    suggestions = advise(j)
    assert suggestions and all(any(name == "train.seq_len" for name, _, _ in s.changes) for s in suggestions)


def test_no_dominated_suggestions(job):
    j = job(model='preset = "llama-3.2-3b"', train="micro_batch = 8\nseq_len = 4096", cluster="gpu = 'A10G'")
    suggestions = advise(j)
    for i, a in enumerate(suggestions):
        for b in suggestions[i + 1:]:
            assert not set(a.changes) <= set(b.changes)


def test_liger_is_a_lever_for_hugging_face_trainer_jobs_only(job):
    """A Trainer job that does not fit can switch on use_liger_kernel (Liger's fused loss and block
    kernels: the same model, nothing else trained differently); podkit's own stack cannot."""
    train = "precision = 'bf16-mixed'\nmicro_batch = 4\nseq_len = 2048\nlora_rank = 16\n"
    hf = job(model='preset = "llama-3.1-8b"', train=train + "stack = 'hf'", cluster="gpu = 'L40S'")
    assert not estimate(hf).fits
    liger = [s for s in advise(hf) if ("train.block_kernels", "torch", "liger") in s.changes]
    assert liger and not liger[0].caveat and ("train.loss", "stack", "liger") in liger[0].changes
    assert "use_liger_kernel" in liger[0].describe()
    assert liger[0].estimate.total < estimate(hf.replace(train={"micro_batch": 2, "grad_accum": 2})).total
    podkit = job(model='preset = "llama-3.1-8b"', train=train, cluster="gpu = 'L40S'")
    assert not any(name in ("train.loss", "train.block_kernels") for s in advise(podkit) for name, _, _ in s.changes)


def _every_option_in_full(job, limit=4):
    """The advisor's answer the slow way: every option at every micro-batch estimated in full (allocator
    replays included), the largest fitting micro-batch kept per option, then the same ranking and choice."""
    from podkit.checks import advisor

    base, host_known = advisor._cost(job), job.cluster.host_ram_gb > 0
    seen, found = set(), []
    for allow_seq in (False, True):
        for index, batches in enumerate(advisor.valid_options(job, allow_seq, seen)):
            fitting = [(i, est) for i in range(len(batches.sizes))
                       if advisor._fits(est := estimate(batches.at(i)), host_known)]
            if not fitting or not advisor._changes(job, batches.at(fitting[0][0])):
                continue
            (i, est), candidate = fitting[0], batches.at(fitting[0][0])
            found.append((advisor._rank(job, candidate, i, base) + (est.total,), index,
                          advisor.Suggestion(advisor._changes(job, candidate), est, 0.0, "")))
        if found:
            break
    return [(s.changes, s.estimate.total) for _, _, s in advisor._choose(found, limit)]


def test_the_bounded_search_finds_what_estimating_every_option_finds(job):
    """advise() estimates in full (replaying the allocator) only the options whose tensors alone fit and that
    could still rank among the chosen: on a job near its card's limit with FSDP1 replays, a job that needs
    micro-batch halvings, one only a shorter context saves, and one whose memory rises on the first halving,
    its answer is the exhaustive one."""
    fsdp_qlora = job(model='preset = "llama-2-7b"',
                     train="precision = 'bf16'\nmicro_batch = 4\nseq_len = 2048\ncheckpointing = 'full'\n"
                           "lora_rank = 64\nstack = 'fsdp_qlora'\nlora_targets = ['q_proj', 'v_proj']",
                     cluster="gpu = 'RTX3090'\ngpus_per_node = 2\nsharding = 'none'\nhost_ram_gb = 128")
    halvings = job(model='preset = "llama-3.2-3b"', train="micro_batch = 8\nseq_len = 4096", cluster="gpu = 'A10G'")
    context = job(model='preset = "llama-3.1-8b"',
                  train="micro_batch = 1\nseq_len = 65536\nlora_rank = 16\nbase_quant = 'nf4'", cluster="gpu = 'A10G'")
    # Not monotone: halving a micro-batch without accumulation holds the gradients through the next forward
    # (grad_accum 1 -> 2), so Liger alone fits at micro-batch 2 and not at 1.
    held_grads = job(model='preset = "llama-3.2-3b"',
                     train="precision = 'fp16-mixed'\noptimizer = 'adamw8bit'\nmicro_batch = 2\nseq_len = 16384\n"
                           "checkpointing = 'full'\nstack = 'hf'", cluster="gpu = 'L40S'\nhost_ram_gb = 256")
    for j in (fsdp_qlora, halvings, context, held_grads):
        got = [(s.changes, s.estimate.total) for s in advise(j)]
        assert got and got == _every_option_in_full(j)


def test_a_shorter_context_is_the_longest_that_fits(job):
    """Where only a shorter context fits, the advisor offers the longest that does, not the shortest: halving
    it once more would also fit, with less memory, and train on even less of each sequence."""
    j = job(model='preset = "llama-3.1-8b"',
            train="micro_batch = 1\nseq_len = 65536\nlora_rank = 16\nbase_quant = 'nf4'", cluster="gpu = 'A10G'")
    suggestions = advise(j)
    for s in suggestions:
        seq = dict((name, new) for name, _, new in s.changes)["train.seq_len"]
        other = {name: new for name, _, new in s.changes if name != "train.seq_len"}
        longer = j.replace(train={**{k.split(".")[1]: v for k, v in other.items() if k.startswith("train.")},
                                  "seq_len": seq * 2},
                           cluster={k.split(".")[1]: v for k, v in other.items() if k.startswith("cluster.")})
        assert estimate(longer).total > estimate(longer).capacity * (1 - HEADROOM)  # twice as long does not fit
    seqs_alone = [dict((n, v) for n, _, v in s.changes)["train.seq_len"] for s in suggestions if len(s.changes) == 1]
    assert len(seqs_alone) <= 1  # one context per set of other changes


def test_the_floor_is_what_no_allocator_pool_can_lower(job):
    """estimate(replay=False) skips the allocator replays (FSDP1's, the single-GPU step's), which decide only
    pool parts: its floor, the largest tensor and device-only total of any moment, is the full estimate's,
    and never above the full total."""
    fsdp1 = job(model='preset = "llama-2-7b"',
                train="precision = 'bf16'\nmicro_batch = 2\nseq_len = 2048\ncheckpointing = 'full'\nlora_rank = 64\n"
                      "stack = 'fsdp_qlora'", cluster="gpu = 'RTX3090'\ngpus_per_node = 2\nsharding = 'zero3'")
    one_gpu = job(model='preset = "mistral-7b"',
                  train="precision = 'bf16-mixed'\nmicro_batch = 4\nseq_len = 4096\ncheckpointing = 'full'\n"
                        "lora_rank = 16\nstack = 'hf'\ntransformers = '4.48.1'\nattention = 'flash-attn'",
                  cluster="gpu = 'A100-80GB'")
    for j, replayed in ((fsdp1, "default-stream segments of the wrap"), (one_gpu, "segments the step's")):
        full, lite = estimate(j), estimate(j, replay=False)
        assert any(p.label.startswith(replayed) for p in full.parts)
        assert not any(p.label.startswith(replayed) for parts in lite.phase_parts.values() for p in parts)
        assert lite.floor == full.floor <= full.total


def test_a_stack_whose_selective_is_block_recompute_is_offered_full_at_its_cost(job):
    """Hugging Face's gradient_checkpointing (and litgpt's, torchtune's) recomputes whole decoder layers,
    whatever the job calls it (checks/stacks.py: selective -> "block"): the advisor offers that policy once,
    as "full", costed as full recompute; podkit's own stack keeps its cheaper matmul-keeping "selective"."""
    train = "micro_batch = 1\nseq_len = 2048\nlora_rank = 16\n"
    hf = job(model='preset = "llama-3.2-3b"', train=train + "stack = 'hf'", cluster="gpu = 'A10G'")
    ckpt = [s for s in advise(hf) if any(name == "train.checkpointing" for name, _, _ in s.changes)]
    assert ckpt and all(("train.checkpointing", "none", "full") in s.changes for s in ckpt)
    assert all(s.slowdown >= 1.33 for s in ckpt)
    podkit = job(model='preset = "llama-3.2-3b"', train=train, cluster="gpu = 'A10G'")
    assert any(("train.checkpointing", "none", "selective") in s.changes and s.slowdown < 1.33 for s in advise(podkit))


def test_among_equally_slow_suggestions_the_longer_context_comes_first(job):
    """Llama 3.2 3B at 64k tokens on a T4: Liger's kernels keep 4096 of the context where shortening alone
    keeps 2048, at the same speed; one more change is worth twice the context, so it ranks first."""
    j = job(model='preset = "llama-3.2-3b"', train="micro_batch = 1\nseq_len = 65536\ncheckpointing = 'full'\n"
                                                  "lora_rank = 16\nstack = 'hf'", cluster="gpu = 'T4'")
    suggestions = advise(j)
    seq = [dict((name, new) for name, _, new in s.changes)["train.seq_len"] for s in suggestions]
    ranks = [(bool(s.caveat), round(s.slowdown, 2), -n) for s, n in zip(suggestions, seq)]
    assert ranks == sorted(ranks)
    assert seq[0] > seq[1] and len(suggestions[0].changes) > len(suggestions[1].changes)
    assert suggestions[0].slowdown == suggestions[1].slowdown


def test_a_lever_the_stack_cannot_run_is_left_out_not_raised(job):
    """Phi-3 fuses q, k and v into qkv_proj, and peft has no default LoRA targets for it (peft utils/constants.py
    TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING has no "phi3"): a Hugging Face full fine-tune that does
    not fit used to end preflight with a LoRA-targets error the job never asked about. The LoRA lever is now
    left out, and the others are offered."""
    j = job(model='preset = "phi-3-mini"', train="stack = 'hf'\nmicro_batch = 4\nseq_len = 4096",
            cluster="gpu = 'A10G'")
    assert not estimate(j).fits
    suggestions = advise(j)
    assert suggestions
    assert not any(name == "train.lora_rank" for s in suggestions for name, _, _ in s.changes)


def test_fsdp2_job_is_offered_torchaos_8bit_adamw(job):
    # 8B full fine-tune on 8 x A10G under FSDP2 (zero3): fp32 AdamW states are 8 B/param / 8 ranks, 8 GB per GPU.
    # bitsandbytes' 8-bit states cannot follow FSDP's shards (rules.bnb_sharding); torchao's DTensor states can,
    # at about a quarter of the bytes.
    j = job(model='preset = "llama-3.1-8b"', train="seq_len = 2048\ncheckpointing = 'full'",
            cluster="gpu = 'A10G'\ngpus_per_node = 8\nsharding = 'zero3'")
    changes = [s.changes for s in advise(j)]
    assert (("train.optimizer", "adamw", "torchao_adamw8bit"),) in changes
    assert not any(new == "adamw8bit" for c in changes for _, _, new in c)
