"""What a PyTorch training process holds on an NVIDIA GPU besides the tensors it trains with.

Three things, each from its library's source or, where no source fixes the number, from published
measurements (named, with the range they span).

- The CUDA context: driver state plus the kernels loaded into it. PyTorch sets
  CUDA_MODULE_LOADING=LAZY (torch >= 1.13, pytorch/pytorch PR #86509), so a kernel module loads
  when first used: a bare context, then what the first training steps load.
- cuBLAS workspaces. torch hands cuBLAS a workspace per (handle, stream) taken from the caching
  allocator, so they are tensors to torch.cuda.max_memory_allocated, not device-only memory.
- NCCL: per communicator, a send and a receive buffer per peer connection per channel, and on
  NVSwitch boards of Hopper or later the NVLink SHARP (NVLS) buffers.

Nothing here imports torch: preflight reads it on a laptop.
"""

from __future__ import annotations

from dataclasses import dataclass

from podkit.checks.gpus import GpuSpec

MIB = 1 << 20

# ---- CUDA context ---------------------------------------------------------------------------------
# A bare context under lazy loading (what a process shows after its first tiny tensor, less torch's
# own segment): 254 MiB in PR #86509 (cudaMemGetInfo used 287,047,680 B with a 6.4 MB tensor, which
# the caching allocator serves from a 20 MiB segment), 256 MiB on an RTX 3090 with torch 2.7.1+cu128
# (invoke-ai/InvokeAI#9413, nvidia-smi), "~300MB" (ptrblck, pytorch/pytorch#107667, 2023).
# Spread 254-300 MiB; the two exact figures agree, so 256 MiB.
CUDA_CONTEXT = 256 * MIB
# Kernels the first steps load lazily (cuBLAS/cuBLASLt GEMMs, attention, elementwise, optimizer):
# vLLM measures this as its "non-torch" growth over a forward pass after the context exists:
# 0.16 GiB on an H100 (vllm-project/vllm PR #12126), 0.13-0.14 GiB on an H100 for five models at
# TP=1 (vLLM 0.11 profiling table), 66 MiB (69,206,016 B, vllm PR #14419). Spread 66-164 MiB; a
# training step runs a forward and a backward, so the top of the range: 0.16 GiB.
LAZY_KERNELS = round(0.16 * (1 << 30))

# ---- cuBLAS workspaces (caching allocator) -------------------------------------------------------
# aten/src/ATen/cuda/CublasHandlePool.cpp (torch 2.1-2.6): getCurrentCUDABlasHandle() keeps one
# workspace per (handle, stream), allocated by getNewWorkspace() through
# c10::cuda::CUDACachingAllocator and never freed; default size ":4096:2:16:8" = 2 x 4 MiB + 8 x
# 16 KiB, or 32 MiB (":4096:8") on sm90 - torch 2.7+ also on sm100/sm120, the builds that run
# Blackwell at all. Handles are per thread (DeviceThreadHandlePool): the forward and the optimizer
# run on the Python thread, backward on autograd's device thread, so two handles on the default
# stream. The cuBLASLt workspace of torch 2.2-2.4 (CUDABlas.cpp, CUBLASLT_WORKSPACE_SIZE 1 MiB) is
# allocated and freed per call, a transient inside the allocator.
CUBLAS_HANDLES = 2


def cublas_workspace_bytes(gpu: GpuSpec) -> int:
    """One cuBLAS workspace, as CublasHandlePool.cpp sizes it for this card."""
    if gpu.compute_capability[0] >= 9:
        return 4096 * 8 * 1024
    return 4096 * 1024 * 2 + 16 * 1024 * 8


# ---- NCCL (outside the allocator) ----------------------------------------------------------------
# One P2P connection (src/transport/p2p.cc, NCCL 2.14-2.21): the receiver holds
# sizeof(ncclRecvMem) = 4 KiB + the LL (512 KiB) and LL128 (4,915,200 B) buffers, the sender
# sizeof(ncclSendMem) = 4 KiB, and the 4 MiB Simple buffer (NCCL_BUFFSIZE, init.cc DEFAULT_BUFFSIZE)
# sits on the receiver, or on the sender with P2P read; each side is rounded up to CUDA_IPC_MIN
# = 2 MiB (comm.h). Either way 10 + 2 or 6 + 6 MiB: 12 MiB per connection, half on each rank.
NCCL_CONNECTION = 12 * MIB
# Per channel a rank sends to and receives from its ring neighbours (one connection's worth) and
# its tree parent and children (init.cc connects ring and tree at init up to NCCL 2.21; an
# intra-node tree is a chain: one neighbour with 2 ranks, two in the middle of a longer chain).
# nvidia/nccl#964 (4 x A100 NVLink, torch, one 4 MB all-reduce per group) measured 544 MB per
# 2-rank communicator and 688 MB per larger one: 688 - 544 = 144 = 12 channels x 12 MiB, and
# 544 - 12 x 2 x 12 = 256 MiB that does not scale with connections (communicator state, NCCL's own
# kernels). Channels depend on the links; from NCCL_DEBUG logs:
#   24 on 8-GPU NVSwitch boards (NVIDIA/nccl-tests#100, HGX A100 "Channel 23/24";
#      NVIDIA/nccl#1259, HGX H100, channels to 22 and up),
#   12 on NVLink boards without a switch (nccl#964 above),
#    4 between PCIe cards (NVIDIA/nccl#1706, 2 PCIe GPUs: "4 coll channels").
NCCL_COMM_BASE = 256 * MIB
NCCL_CHANNELS_NVSWITCH = 24
NCCL_CHANNELS_NVLINK = 12
NCCL_CHANNELS_PCIE = 4
# NVLS (src/transport/nvls.cc, NCCL 2.18-2.20: torch 2.1-2.4's wheels): when the GPUs sit on an NVSwitch with
# multicast (Hopper or later, SXM) and a node has more than 2 of them, init maps per rank
# NVLS_NCHANNELS (16) x 2 x (NCCL_BUFFSIZE 4 MiB + NVLS_MEM_ALIGN_SIZE 2 MiB) x nHeads (the local
# ranks). NCCL 2.21 cut the buffer to NVLS_CHUNKSIZE 128 KiB x NCCL_STEPS 8 = 1 MiB (3 MiB with the
# alignment): half this. NVIDIA's own launchers turn NVLS off to save this memory
# (NVIDIA/NeMo-Framework-Launcher#127, NVIDIA/JAX-Toolbox#383).
NVLS_CHANNELS = 16
NVLS_BUFFER = 4 * MIB + 2 * MIB
NVSWITCH_MULTICAST = ("H100-SXM", "H200", "B200")  # HGX/DGX boards; NVLink bridges and PCIe have no multicast
NVLINK_WITHOUT_SWITCH = ("V100", "V100-32GB", "A100-40GB", "A100-80GB")


@dataclass(frozen=True)
class Overhead:
    """One piece of what the process holds besides its training tensors."""

    label: str
    bytes: int
    formula: str
    where: str  # "tensor": inside torch's caching allocator; "device": only nvidia-smi sees it


def nccl_channels(gpu: GpuSpec, gpus_per_node: int) -> int:
    if gpu.name in NVSWITCH_MULTICAST or (gpu.name.startswith("A100") and gpus_per_node == 8):
        return NCCL_CHANNELS_NVSWITCH  # an 8-GPU A100 node is an HGX board with NVSwitch
    if gpu.name in NVLINK_WITHOUT_SWITCH:
        return NCCL_CHANNELS_NVLINK
    return NCCL_CHANNELS_PCIE


def nccl_bytes(gpu: GpuSpec, gpus_per_node: int, nodes: int) -> tuple[int, str]:
    """Device memory of one NCCL communicator on one rank, and how it was counted."""
    ranks = gpus_per_node * nodes
    if ranks < 2:
        return 0, "no communicator"
    channels = nccl_channels(gpu, gpus_per_node)
    tree = 1 if ranks == 2 else 2
    buffers = channels * (1 + tree) * NCCL_CONNECTION
    how = (f"{NCCL_COMM_BASE // MIB} MiB + {channels} channels x (ring 1 + tree {tree}) x "
           f"{NCCL_CONNECTION // MIB} MiB")
    nvls = 0
    if gpu.name in NVSWITCH_MULTICAST and gpus_per_node > 2:
        nvls = NVLS_CHANNELS * 2 * NVLS_BUFFER * gpus_per_node
        how += f" + NVLS {NVLS_CHANNELS} x 2 x {NVLS_BUFFER // MIB} MiB x {gpus_per_node} local ranks"
    return NCCL_COMM_BASE + buffers + nvls, how


def overheads(gpu: GpuSpec, gpus_per_node: int, nodes: int) -> list[Overhead]:
    """What a training process on this card and cluster holds besides its tensors, largest first."""
    ws = cublas_workspace_bytes(gpu)
    out = [Overhead("CUDA context", CUDA_CONTEXT + LAZY_KERNELS,
                    f"{CUDA_CONTEXT // MIB} MiB bare context + 0.16 GiB of kernels the first steps load lazily",
                    "device"),
           Overhead("cuBLAS workspaces", CUBLAS_HANDLES * ws,
                    f"{CUBLAS_HANDLES} handles (forward thread, autograd thread) x {ws:,} B, from the caching allocator",
                    "tensor")]
    nccl, how = nccl_bytes(gpu, gpus_per_node, nodes)
    if nccl:
        out.append(Overhead("NCCL buffers", nccl, how, "device"))
    return out
