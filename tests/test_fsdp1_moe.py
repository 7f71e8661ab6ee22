"""FSDP1 (HF Trainer + accelerate) over MoE blocks: the wrap, load and step replays of checks/fsdp1.py with transformers
4.x's expert loop (MixtralSparseMoeBlock), with the bytes derived by hand."""

from podkit.checks import activations as A
from podkit.checks import fsdp1, step_replay
from podkit.checks.memory import _fsdp1_units, _quantized_load_order, estimate

from test_step_replay import tiny_mixtral

H, F, KV = 4096, 14336, 1024  # Mixtral 8x7B: hidden, one expert's ffn, k/v width (8 kv heads x 128)
TRAIN = ('stack = "hf"\ntransformers = "4.48.1"\nprecision = "bf16"\nmicro_batch = 2\nseq_len = 4096\n'
         'checkpointing = "full"\nattention = "flash-attn"\nlora_rank = 16\nloss = "stack"\n'
         'lora_targets = ["q_proj", "k_proj", "v_proj", "o_proj"]')
TWO_GPUS = 'gpu = "A100-80GB"\ngpus_per_node = 2\nsharding = "zero3"'


def test_mixtral_quantizes_its_experts_in_checkpoint_order_by_hand(job):
    j = job(model='preset = "mixtral-8x7b"', train=TRAIN + '\nbase_quant = "nf4"\nlora_dtype = "compute"',
            cluster=TWO_GPUS)
    # A block's keys sorted as safetensors lists them: block_sparse_moe.experts.0.w1, .w2, .w3, ... experts.7.w3
    # (4096 x 14336 each), block_sparse_moe.gate (4096 x 8), then self_attn.k_proj, o_proj, q_proj, v_proj.
    block = [H * F] * 24 + [H * 8] + [H * KV, H * H, H * H, H * KV]
    assert _quantized_load_order(j) == tuple(block) * 32


def test_fsdp1_replays_the_wrap_of_moe_units(job):
    j = job(model='preset = "mixtral-8x7b"', train=TRAIN, cluster=TWO_GPUS)
    units = _fsdp1_units(j, 2)
    # 32 blocks, each with 4 x 2 LoRA units of its own (peft's fsdp_auto_wrap_policy), then the root.
    assert len(units) == 32 * 9 + 1
    unit = sum(units[-2][0])
    assert unit == 2 * (24 * H * F + H * 8 + 2 * H * H + 2 * H * KV) + 2 * 2 * H  # + two bf16 norms
    shards = sum(-(-sum(p) // 2) for p, _ in units)
    est = estimate(j)
    wrap = [p for p in est.phase_parts["step"] if p.label.startswith("default-stream segments of the wrap")]
    assert wrap, "a MoE FSDP1 job is replayed, not priced by the closed form"
    replayed = int(wrap[0].formula.split("reserves ")[1].split(" B")[0].replace(",", ""))
    # Each unit's parameters are moved to the GPU one by one (112 MiB per expert weight), then flattened into one
    # new unit-sized tensor (torch.cat): the flat parameter cannot reuse the moved weights' blocks, nor the next
    # unit's moved weights the flat parameter's, so the wrap leaves both cached beside the live shards.
    assert replayed >= shards + 2 * unit


def test_fsdp1_routes_each_experts_tensors_by_its_rows_in_forward_and_recompute(job, tmp_path):
    j = job(model=tiny_mixtral(tmp_path), train=TRAIN.replace("micro_batch = 2", "micro_batch = 8")
            .replace("seq_len = 4096", "seq_len = 1024"), cluster=TWO_GPUS)
    bf, s = A.block_facts(j), j.shape
    assert bf.expert_loop and s.moe.experts == 4
    T = 8 * 1024
    rows = (1024, 3072, 5120, 7168)  # 16,384 = T x top-2 routed rows, deliberately uneven
    routing = (rows,) * s.layers
    names: dict = {}
    events = fsdp1.forward_events(s, T, 2, frozenset(), False, names=names, batch=8, moe=bf, routing=routing)
    block = step_replay.backward_replay(bf, True)
    events += fsdp1.backward_events(names, s, T, 2, block, kept=True,
                                    experts=step_replay.backward_experts(bf, True), routing=routing)
    tr, _ = A._walk_block(bf, True)
    gathered = {id(t): tr.expert_of[id(t)] for op in tr.ops for t in op.outputs
                if t.label == "tokens gathered for an expert"}
    sizes = [(ev[1], ev[2]) for ev in events if ev[0] == "a" and isinstance(ev[1], tuple) and ev[1][1] in gathered]
    # hidden_states[top_x]: each expert's rows x 256 x 2 B, once in the first forward and once in the recompute.
    for i in range(s.layers):
        for key, expert in gathered.items():
            assert [n for k, n in sizes if k == (i, key)] == [256 * 2 * rows[expert]] * 2
