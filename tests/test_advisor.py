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
