"""System metrics as a job monitor shows them (llview at JSC), sampled in a background thread.

Every rank samples its own process (CPU use and resident memory, with psutil) and, on a GPU, its
own GPU (utilisation, memory used, power, temperature, with NVML from the `nvidia-ml-py`
package; on an AMD GPU with ROCm's `amdsmi` package, behind the same few NVML calls). The training monitor (utils/monitor.py) gathers the means of all ranks at each log
step, so TensorBoard and wandb get one curve per node and GPU. The CPU path runs in CI, the GPU
path wherever there is one: the same code, only the source of the numbers differs.

Sampling costs the training step nothing it would notice: a sample every few seconds, and
NVML's calls release the GIL while they wait for the driver (docs/benchmarks.md measures it).
"""

from __future__ import annotations

import math
import threading

import psutil

# What each rank reports, in this order (NaN where it does not apply, e.g. GPU values on a CPU).
FIELDS = ("cpu_percent", "rss_gib", "gpu_utilization", "gpu_memory_gib", "gpu_power_w",
          "gpu_temperature_c")
SAMPLE_SECONDS = 5.0


def nvml_handle(device, nvml=None):
    """The NVML handle of the GPU torch calls `device`, or None (a CPU, or no NVML).

    By UUID: CUDA's device numbers count only the visible GPUs (CUDA_VISIBLE_DEVICES, Slurm's
    cgroups), NVML's count all of the node's.
    """
    if device.type != "cuda":
        return None
    try:
        nvml = nvml or _import_nvml()
        import torch
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        return nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
    except Exception:  # no driver library, an old driver, a MIG slice: GPU values stay NaN
        return None


def _import_nvml():
    import pynvml  # the nvidia-ml-py package
    pynvml.nvmlInit()
    return pynvml


class AmdSmiAsNvml:
    """The NVML calls SystemSampler makes, answered by AMD SMI (`amdsmi`, the Python package that
    comes with ROCm: rocm-smi's library). A handle is (amdsmi's handle, its index on the node)."""

    NVML_TEMPERATURE_GPU = 0

    def __init__(self, amdsmi):
        self.smi = amdsmi

    def nvmlDeviceGetUtilizationRates(self, h):
        class Rates:
            gpu = self.smi.amdsmi_get_gpu_activity(h[0])["gfx_activity"]
        return Rates()

    def nvmlDeviceGetMemoryInfo(self, h):
        class Memory:
            used = self.smi.amdsmi_get_gpu_memory_usage(h[0], self.smi.AmdSmiMemoryType.VRAM)
        return Memory()

    def nvmlDeviceGetPowerUsage(self, h):  # milliwatts, as NVML's; AMD SMI says watts
        power = self.smi.amdsmi_get_power_info(h[0])
        watts = power.get("current_socket_power")
        if not isinstance(watts, (int, float)):  # "N/A" on MI250X: the average is there
            watts = power["average_socket_power"]
        return float(watts) * 1000.0

    def nvmlDeviceGetTemperature(self, h, sensor):
        return self.smi.amdsmi_get_temp_metric(h[0], self.smi.AmdSmiTemperatureType.HOTSPOT,
                                               self.smi.AmdSmiTemperatureMetric.CURRENT)

    def nvmlDeviceGetIndex(self, h):
        return h[1]


def amdsmi_handle(device, smi: AmdSmiAsNvml | None = None):
    """(AMD SMI's handle, its index) of the GPU torch calls `device` on a ROCm build, or None.

    By PCI address (domain:bus:device), for the same reason as NVML's by UUID: torch counts the
    visible GPUs only, AMD SMI all of the node's.
    """
    import torch
    if device.type != "cuda" or not getattr(torch.version, "hip", None):
        return None
    try:
        smi = smi or _import_amdsmi()
        p = torch.cuda.get_device_properties(device)
        mine = (p.pci_domain_id, p.pci_bus_id, p.pci_device_id)
        for i, h in enumerate(smi.smi.amdsmi_get_processor_handles()):
            domain, bus, rest = smi.smi.amdsmi_get_gpu_device_bdf(h).split(":")
            if (int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16)) == mine:
                return (h, i)
    except Exception:  # no amdsmi package or library, an old ROCm: GPU values stay NaN
        pass
    return None


def _import_amdsmi() -> AmdSmiAsNvml:
    import amdsmi  # ROCm's package (share/amd_smi in a ROCm installation, in ROCm's images)
    amdsmi.amdsmi_init()
    return AmdSmiAsNvml(amdsmi)


def nvml_index(handle, nvml) -> int:
    """The GPU's number on its node as nvidia-smi and llview show it; -1 without one."""
    if handle is None:
        return -1
    try:
        return int(nvml.nvmlDeviceGetIndex(handle))
    except Exception:
        return -1


class SystemSampler:
    """Samples this process (and its GPU) every `seconds` in a daemon thread.

    take() returns the mean of the samples since the previous take(), one value per FIELDS entry;
    if none was taken in between (a short interval), it samples once itself.
    """

    def __init__(self, gpu_handle=None, nvml=None, seconds: float = SAMPLE_SECONDS):
        self.gpu, self.nvml, self.seconds = gpu_handle, nvml, seconds
        self.process = psutil.Process()
        self.process.cpu_percent(None)  # the first call only starts psutil's CPU-time clock
        self._samples, self._lock, self._stop = [], threading.Lock(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="system-metrics", daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(self.seconds):
            sample = self.sample()
            with self._lock:
                self._samples.append(sample)

    def sample(self) -> list[float]:
        values = [self.process.cpu_percent(None), self.process.memory_info().rss / 2**30]
        values += self._gpu_sample()
        return values

    def _gpu_sample(self) -> list[float]:
        if self.gpu is None:
            return [math.nan] * 4
        nvml, h = self.nvml, self.gpu
        readers = (lambda: nvml.nvmlDeviceGetUtilizationRates(h).gpu,
                   lambda: nvml.nvmlDeviceGetMemoryInfo(h).used / 2**30,
                   lambda: nvml.nvmlDeviceGetPowerUsage(h) / 1000.0,  # milliwatts
                   lambda: nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU))
        values = []
        for read in readers:
            try:
                values.append(float(read()))
            except Exception:  # a value this GPU does not report (NVMLError_NotSupported)
                values.append(math.nan)
        return values

    def take(self) -> list[float]:
        with self._lock:
            samples, self._samples = self._samples, []
        if not samples:
            samples = [self.sample()]
        return [sum(column) / len(column) for column in zip(*samples)]

    def close(self):
        self._stop.set()
        self._thread.join(timeout=self.seconds + 1)


def start_sampler(device, seconds: float = SAMPLE_SECONDS) -> tuple[SystemSampler, int]:
    """(a running sampler for this process and its GPU, the GPU's NVML index or -1)."""
    nvml = None
    handle = None
    if device.type == "cuda":
        import torch
        try:
            if getattr(torch.version, "hip", None):  # an AMD GPU: AMD SMI answers NVML's calls
                nvml = _import_amdsmi()
                handle = amdsmi_handle(device, nvml)
            else:
                nvml = _import_nvml()
                handle = nvml_handle(device, nvml)
        except Exception:
            nvml = handle = None
    return SystemSampler(handle, nvml, seconds), nvml_index(handle, nvml)
