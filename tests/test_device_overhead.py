"""What a training process holds besides its tensors, against hand derivations from the sources
named in checks/device_overhead.py (CublasHandlePool.cpp, NCCL p2p.cc / nvls.cc, nccl#964)."""

from podkit.checks.device_overhead import nccl_bytes, overheads
from podkit.checks.gpus import lookup
from podkit.checks.memory import estimate

MIB = 1 << 20
CONTEXT = 256 * MIB + round(0.16 * (1 << 30))


def by_label(gpu, per_node=1, nodes=1):
    return {o.label: o for o in overheads(lookup(gpu), per_node, nodes)}


def test_one_gpu_has_context_and_cublas_workspaces_but_no_nccl():
    h100, rtx = by_label("H100-SXM"), by_label("RTX3090")
    # 256 MiB bare lazy context + 0.16 GiB of kernels the first steps load.
    assert h100["CUDA context"].bytes == rtx["CUDA context"].bytes == CONTEXT
    assert h100["CUDA context"].where == "device"
    # Two handles (Python thread, autograd's device thread) x one workspace each: 32 MiB on sm90,
    # :4096:2:16:8 = 2 x 4 MiB + 8 x 16 KiB elsewhere; inside the caching allocator.
    assert h100["cuBLAS workspaces"].bytes == 2 * 32 * MIB
    assert rtx["cuBLAS workspaces"].bytes == 2 * (8 * MIB + 128 * 1024)
    assert h100["cuBLAS workspaces"].where == "tensor"
    assert "NCCL buffers" not in h100 and "NCCL buffers" not in rtx


def test_nccl_reproduces_the_a100_nvlink_measurement_it_is_built_from():
    # nccl#964, 4 x A100 NVLink: 544 MB per 2-rank communicator, 688 MB per larger one.
    # 256 MiB + 12 channels x (ring 1 + tree 1 or 2) x 12 MiB per connection.
    assert nccl_bytes(lookup("A100-80GB"), 2, 1)[0] == 544 * MIB
    assert nccl_bytes(lookup("A100-80GB"), 4, 1)[0] == 688 * MIB


def test_nccl_by_interconnect_by_hand():
    # 8 x H100 SXM (HGX, NVSwitch with multicast): 24 channels x 3 connections x 12 MiB, and NVLS
    # 16 channels x 2 x (4 MiB + 2 MiB) x 8 local ranks = 1.5 GiB.
    h100x8 = (256 + 24 * 3 * 12 + 16 * 2 * 6 * 8) * MIB
    assert nccl_bytes(lookup("H100-SXM"), 8, 1)[0] == h100x8
    # Two ranks on the same board: NVLS needs more than two GPUs (nvls.cc gpuCount <= 2).
    assert nccl_bytes(lookup("H100-SXM"), 2, 1)[0] == (256 + 24 * 2 * 12) * MIB
    # H100 PCIe: no NVSwitch, no NVLS, PCIe channel count.
    assert nccl_bytes(lookup("H100-PCIe"), 8, 1)[0] == (256 + 4 * 3 * 12) * MIB
    # An 8-GPU A100 node is an HGX board: NVSwitch channels, but Ampere has no NVLS.
    assert nccl_bytes(lookup("A100-80GB"), 8, 1)[0] == (256 + 24 * 3 * 12) * MIB
    # Two RTX 3090s over PCIe.
    assert nccl_bytes(lookup("RTX3090"), 2, 1)[0] == (256 + 4 * 2 * 12) * MIB
    # Two nodes of 8: the same per-rank buffers (NVLS heads are the local ranks).
    assert nccl_bytes(lookup("H100-SXM"), 8, 2)[0] == h100x8
    # One GPU per node on two nodes still has a communicator (ring and tree over the network).
    assert nccl_bytes(lookup("A10G"), 1, 2)[0] == (256 + 4 * 2 * 12) * MIB
    assert nccl_bytes(lookup("A10G"), 1, 1)[0] == 0


def device_only(est):
    return sum(p.bytes for p in est.parts if p.where == "device")


def test_estimate_counts_workspaces_as_allocated_and_the_rest_as_device_only(job):
    one = estimate(job(cluster="gpu = 'H100'"))
    eight = estimate(job(cluster="gpu = 'H100'\ngpus_per_node = 8"))
    for est in (one, eight):
        for phase, parts in est.phase_parts.items():
            ws = [p for p in parts if p.label == "cuBLAS workspaces"]
            assert [p.where for p in ws] == ["tensor"], phase
            ctx = [p for p in parts if p.label == "CUDA context"]
            assert [p.where for p in ctx] == ["device"], phase
    assert device_only(one) == CONTEXT
    # DDP over 8 H100 SXM adds one communicator's buffers; the tensors stay those of one replica.
    assert device_only(eight) - device_only(one) == (256 + 24 * 3 * 12 + 16 * 2 * 6 * 8) * MIB
    # A CPU run has no cuBLAS handle: the workspaces are not its allocations.
    cpu = estimate(job(cluster="gpu = 'H100'"), device="cpu")
    assert not any(p.label == "cuBLAS workspaces" for p in cpu.parts)
