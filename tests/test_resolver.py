"""The dependency resolver on recorded pod fingerprints (tests/fingerprints/, parsed by the real probe parser).

flash-attn's index and release pages are served from 127.0.0.1: an index listing its releases
(PEP 503 HTML, as pip reads it) and, per release, the wheels flash-attn's CI published for it.
"""

import functools
import http.server
import threading
from pathlib import Path

import pytest

from podkit.envsetup import resolve as resolve_module
from podkit.envsetup.cli import requirements
from podkit.envsetup.wheels import WheelSource, flash_attn_wheel_name
from podkit.envsetup.fingerprint import TorchBuild, parse_probe
from podkit.pods.profiles import detect

FINGERPRINTS = Path(__file__).parent / "fingerprints"
# (release, torch minors with wheels): flash-attn's published wheel matrix for two real releases,
# and a later one with wheels for torch 2.13 only, as a release after this test was written would be.
RELEASES = [("2.7.4.post1", range(2, 7)), ("2.8.3", range(4, 9)), ("2.9.1", [13])]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    root = tmp_path_factory.mktemp("index")
    (root / "simple" / "flash-attn").mkdir(parents=True)
    names = [f"flash_attn-{v}.tar.gz" for v, _ in RELEASES] + ["flash_attn-3.0.0b1.tar.gz"]  # a pre-release: ignored
    (root / "simple" / "flash-attn" / "index.html").write_text(
        "".join(f'<a href="../../files/{n}">{n}</a>\n' for n in names))
    for version, minors in RELEASES:
        (root / "releases" / f"v{version}").mkdir(parents=True)
        for minor in minors:
            for abi in (True, False):
                for py in ("cp310", "cp311", "cp312"):
                    name = flash_attn_wheel_name(version, "12.4", f"2.{minor}.0", abi, py)
                    (root / "releases" / f"v{version}" / name).write_bytes(b"wheel")
    # torch and bitsandbytes as an index serves them: two torch builds, and two bitsandbytes
    # releases whose Requires-Dist differ as the real ones do (0.50.2: torch>=2.4, 0.45.5: torch).
    for project, version, requires in (("torch", "2.1.0+cu118", None), ("torch", "2.4.1+cu124", None),
                                       ("bitsandbytes", "0.45.5", "torch"), ("bitsandbytes", "0.50.2", "torch>=2.4")):
        _wheel(root / "files", project, version, requires)
    for project in ("torch", "bitsandbytes"):
        (root / "simple" / project).mkdir(parents=True)
        links = "".join(f'<a href="../../files/{w.name}">{w.name}</a>\n' for w in sorted((root / "files").glob(f"{project}-*")))
        (root / "simple" / project / "index.html").write_text(links)
    handler = functools.partial(_Quiet, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    yield WheelSource(index_url=f"{base}/simple", releases_url=f"{base}/releases", timeout=5)
    server.shutdown()


def _wheel(where: Path, project: str, version: str, requires: str | None) -> Path:
    """A minimal valid wheel (PEP 427): metadata only, enough for pip's resolver."""
    import zipfile

    where.mkdir(parents=True, exist_ok=True)
    info = f"{project}-{version}.dist-info"
    path = where / f"{project}-{version}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n" + (f"Requires-Dist: {requires}\n" if requires else "")
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{info}/METADATA", meta)
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return path


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def load(name):
    return parse_probe((FINGERPRINTS / f"{name}.txt").read_text())


def resolve(fp, reqs, wheels=None):
    assert wheels is not None or not fp.gpus, "GPU plans must use the local wheel server"
    return resolve_module.resolve(fp, reqs, wheels)


def test_runpod_a100_gets_the_matching_prebuilt_flash_attn_wheel(wheels):
    fp = load("runpod-a100")
    assert detect(fp).name == "runpod" and fp.gpus[0].sm == 80 and fp.torch.cxx11_abi is False
    plan = resolve(fp, requirements(), wheels)
    assert plan.dep("torch").action == "reuse" and plan.constraints == ["torch==2.4.1+cu124"]
    fa = plan.dep("flash-attn")
    assert fa.action == "pip"
    assert fa.requirement == f"{wheels.releases_url}/v2.8.3/flash_attn-2.8.3%2Bcu12torch2.4cxx11abiFALSE-cp311-cp311-linux_x86_64.whl"
    # bitsandbytes: pip picks the release for this torch, held by the constraint
    assert plan.dep("bitsandbytes").requirement == "bitsandbytes" and "torch==2.4.1+cu124" in plan.constraints
    assert plan.attention == "flash-attn" and not plan.warnings


def test_rtx4090_with_cuda11_torch_falls_back_to_sdpa_with_the_reason(wheels):
    plan = resolve(load("runpod-rtx4090"), requirements(), wheels)
    assert plan.constraints == ["torch==2.1.0+cu118"] and plan.dep("bitsandbytes").action == "pip"
    assert plan.dep("flash-attn").action == "skip"
    assert plan.attention == "sdpa" and "CUDA 12" in plan.attention_reason


def test_sagemaker_g5_torch22_uses_the_conda_env_and_an_older_wheel(wheels):
    fp = load("sagemaker-g5-torch22")
    profile = detect(fp)
    assert profile.name == "sagemaker"
    assert "activate /home/ec2-user/anaconda3/envs/pytorch_p310" in profile.prelude
    assert profile.remote_dir("proj", fp.home) == "/home/ec2-user/SageMaker/proj"
    plan = resolve(fp, requirements(), wheels)
    assert "v2.7.4.post1/flash_attn-2.7.4.post1%2Bcu12torch2.2cxx11abiFALSE-cp310-cp310" in plan.dep("flash-attn").requirement


def test_t4_is_sm75_so_no_flash_attn(wheels):
    plan = resolve(load("t4"), requirements(), wheels)
    assert plan.dep("flash-attn").action == "skip" and "sm_75" in plan.attention_reason
    assert plan.dep("bitsandbytes").action == "pip"  # 8-bit optimizers run on Turing


def test_rtx5090_with_old_torch_is_warned_and_gets_no_gpu_kernels_installed(wheels):
    fp = load("rtx5090-old-torch")
    assert fp.torch.supports(120) is False and fp.torch.supports(86) is True
    plan = resolve(fp, requirements(), wheels)
    assert any("sm_120" in w and "torch>=2.7" in w for w in plan.warnings)
    assert plan.dep("flash-attn").action == "skip" and "sm_120" in plan.attention_reason


def test_build_path_sizes_jobs_from_free_ram_and_targets_the_detected_arch(wheels):
    fp = load("runpod-a100")
    fp.torch = type(fp.torch)("2.9.0+cu128", "12.8", "", ("sm_80", "sm_90", "sm_100", "sm_120"), True)
    fp.nvcc_version, fp.ram_available_mib, fp.cpus = "12.8", 40 * 1024, 32
    fa = resolve(fp, requirements(), wheels).dep("flash-attn")
    env = dict(fa.build_env)
    assert fa.action == "build" and env["MAX_JOBS"] == "5" and env["FLASH_ATTN_CUDA_ARCHS"] == "80"
    assert fa.requirement == "flash-attn==2.9.1"  # the newest release, from the index
    fp.ram_available_mib = 4 * 1024  # too little RAM to build at all
    assert resolve(fp, requirements(), wheels).dep("flash-attn").action == "skip"
    fp.nvcc_version = None
    assert "no nvcc" in resolve(fp, requirements(), wheels).dep("flash-attn").reason


@pytest.mark.parametrize("minor", range(2, 14))
def test_every_torch_from_2_2_to_2_13_gets_the_newest_wheel_that_exists(wheels, minor):
    fp = load("runpod-a100")
    fp.torch = TorchBuild(f"2.{minor}.1+cu124", "12.4", "", ("sm_80", "sm_90"), True)
    fp.nvcc_version, fp.ram_available_mib = "12.4", 64 * 1024
    fa = resolve(fp, requirements(), wheels).dep("flash-attn")
    published = [v for v, minors in RELEASES if minor in minors]
    if published:
        newest = max(published, key=lambda v: tuple(int(x) for x in v.split(".")[:3]))
        assert fa.action == "pip" and f"/v{newest}/" in fa.requirement and f"torch2.{minor}cxx11abiTRUE" in fa.requirement
        assert wheels.exists(fa.requirement)
    else:  # torch 2.9 to 2.12: no wheel anywhere, so a source build of the newest release
        assert fa.action == "build" and fa.requirement == "flash-attn==2.9.1", fa


def test_an_unreachable_index_means_a_build_not_a_crash():
    fp = load("runpod-a100")
    fp.nvcc_version, fp.ram_available_mib = "12.4", 64 * 1024
    closed = WheelSource(index_url="http://127.0.0.1:9/simple", releases_url="http://127.0.0.1:9/releases", timeout=2)
    fa = resolve(fp, requirements(), closed).dep("flash-attn")
    assert fa.action == "build" and fa.requirement == "flash-attn"


def test_cpu_machine_without_torch_gets_the_pinned_cpu_build():
    fp = load("t4")
    fp.gpus, fp.torch = [], None
    plan = resolve(fp, requirements())
    assert plan.dep("torch").action == "pip" and plan.dep("torch").requirement == "torch==2.13.0"
    assert plan.dep("bitsandbytes").action == "skip"


def test_gpu_pod_without_torch_never_installs_torch(wheels):
    fp = load("runpod-a100")
    fp.torch = None
    plan = resolve(fp, requirements(), wheels)
    assert plan.dep("torch").action == "skip" and "never installs CUDA torch" in plan.dep("torch").reason


@pytest.mark.parametrize("name", ["runpod-a100", "t4"])
def test_step_keys_change_exactly_when_their_inputs_do(wheels, name):
    fp = load(name)
    key = resolve(fp, requirements(), wheels).dep("bitsandbytes").key(fp)
    assert resolve(fp, requirements(), wheels).dep("bitsandbytes").key(fp) == key
    fp.torch = type(fp.torch)("2.6.0+cu124", fp.torch.cuda, fp.torch.path, fp.torch.arch_list, fp.torch.cxx11_abi)
    assert resolve(fp, requirements(), wheels).dep("bitsandbytes").key(fp) != key


@pytest.mark.parametrize("name, expected", [("runpod-rtx4090", "0.45.5"), ("runpod-a100", "0.50.2")])
def test_pip_picks_the_bitsandbytes_release_the_pods_torch_admits(wheels, tmp_path, name, expected):
    """The plan's requirement and constraints, given to pip itself (dry run) against the local index."""
    import json
    import subprocess
    import sys

    plan = resolve(load(name), requirements(), wheels)
    dep = plan.dep("bitsandbytes")
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("\n".join(plan.constraints) + "\n")
    report = tmp_path / "report.json"
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                          "--disable-pip-version-check", "--report", str(report), "--index-url", wheels.index_url,
                          "-c", str(constraints), dep.requirement], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PIP_NO_INPUT": "1", "PIP_CONFIG_FILE": "/dev/null"})
    assert out.returncode == 0, out.stderr
    chosen = {i["metadata"]["name"]: i["metadata"]["version"] for i in json.loads(report.read_text())["install"]}
    assert chosen["bitsandbytes"] == expected and chosen["torch"] == plan.constraints[0].split("==")[1]


# (torch on the pod, the torchao release planned or None), by hand from each release's torchao/__init__.py
# (resolve.TORCHAO_FOR_TORCH's comment): nightlies ("dev", "git") count as patch -1, as torchao reads them.
TORCHAO_PLANS = [("2.4.1+cu124", None), ("2.7.1+cu126", None), ("2.8.0+cu128", "0.13.0"), ("2.9.0+cu128", "0.14.1"),
                 ("2.9.1+cu128", "0.15.0"), ("2.10.0.dev20251101+cu128", "0.15.0"), ("2.10.0+cu128", "0.16.0"),
                 ("2.11.0a0+gitc0ffee", "0.16.0"), ("2.11.0+cu130", "0.18.0"), ("2.13.0+cu130", "0.18.0"),
                 ("2.8.0a0+5228986c39.nv25.06", "0.13.0")]  # NGC's build: neither dev nor git, so 2.8.0 to torchao


@pytest.mark.parametrize("torch_version, release", TORCHAO_PLANS)
def test_torchao_is_the_release_built_for_the_pods_torch(wheels, torch_version, release):
    fp = load("runpod-a100")
    fp.torch = TorchBuild(torch_version, "12.8", "", ("sm_80", "sm_90"), True)
    plan = resolve(fp, requirements(), wheels)
    ao = plan.dep("torchao")
    if release:
        assert (ao.action, ao.requirement, ao.pip_args) == ("pip", f"torchao=={release}", ()), ao
        assert torch_version in ao.reason
    else:
        assert ao.action == "skip" and f"no torchao release is built for torch {torch_version}" in ao.reason, ao
    assert [d.name for d in plan.deps] == ["torch", "requirements", "bitsandbytes", "torchao", "flash-attn"]
    assert plan.constraints == [f"torch=={torch_version}"]  # torchao's pip call keeps the pod's torch too


def test_torchao_follows_the_recorded_pods_and_needs_torch(wheels):
    """The recorded images all run torch older than 2.8: no torchao release is built for them."""
    for name in ("runpod-a100", "runpod-rtx4090", "sagemaker-g5-torch22", "t4", "rtx5090-old-torch"):
        fp = load(name)
        ao = resolve(fp, requirements(), wheels).dep("torchao")
        assert ao.action == "skip" and fp.torch.version in ao.reason, (name, ao)
    fp = load("runpod-a100")
    fp.torch = None
    assert resolve(fp, requirements(), wheels).dep("torchao").reason == "no torch"
    cpu = load("t4")
    cpu.gpus, cpu.torch = [], TorchBuild("2.13.0+cpu", None)  # a CPU machine with the pinned CPU torch
    assert resolve(cpu, requirements()).dep("torchao").requirement == "torchao==0.18.0"
