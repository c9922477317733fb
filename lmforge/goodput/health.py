"""A node's GPU health: a `HealthSource` read by a light sampler thread on the node's first rank.

Two sources: `NvmlHealth` reads NVIDIA's management library (nvidia-ml-py, the ``gpu`` extra) —
XID events (``nvmlEventSet``), uncorrectable ECC errors, failed row remapping, clock-throttle
reasons, temperature, power and SM clock; `InjectedHealth` is driven by fault injection or a test
on any machine (no GPU needed) and otherwise reports a healthy node. The sampler keeps the latest
`HealthSample` for the trainer's log interval; a fatal XID stays reported once seen (a GPU that
fell off the bus does not come back on its own).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Protocol

# NVML's clock-throttle reasons that slow a GPU down for a reason worth an alert: software power cap,
# hardware slowdown, software and hardware thermal slowdown, power brake (nvmlClocksEventReason*).
THROTTLE_ALERTS = {0x4: "power cap", 0x8: "hardware slowdown", 0x20: "thermal (software)",
                   0x40: "thermal (hardware)", 0x80: "power brake"}


@dataclass(frozen=True)
class HealthSample:
    """The worst of a node's GPUs at one moment (zeros: nothing to report, or not measured)."""

    xid: int = 0  # a fatal XID seen (0: none)
    ecc_uncorrected: int = 0
    remap_failed: int = 0  # 1 when a row remapping failed
    throttle: int = 0  # the throttle-reason bits of THROTTLE_ALERTS, OR-ed over the GPUs
    temperature_c: float = 0.0
    power_w: float = 0.0
    sm_clock_mhz: float = 0.0

    def row(self) -> list[float]:
        """In `goodput.conditions.HEALTH` order."""
        return [float(self.xid), float(self.ecc_uncorrected), float(self.remap_failed), float(self.throttle),
                self.temperature_c, self.power_w, self.sm_clock_mhz]


def throttle_text(bits: int) -> str:
    return ", ".join(name for bit, name in THROTTLE_ALERTS.items() if bits & bit)


class HealthSource(Protocol):
    def sample(self) -> HealthSample:
        """The node's health now (XIDs since the last call included)."""

    def close(self) -> None:
        """Release what the source holds."""


class InjectedHealth:
    """A healthy node until told otherwise (`report`): the fault injector's and the tests' source."""

    def __init__(self) -> None:
        self._now = HealthSample()
        self._lock = threading.Lock()

    def report(self, **fields) -> None:
        with self._lock:
            self._now = replace(self._now, **fields)

    def sample(self) -> HealthSample:
        with self._lock:
            return self._now

    def close(self) -> None:
        pass


class NvmlHealth:
    """NVML (nvidia-ml-py): every GPU this node's process sees. Raises ImportError or pynvml's
    NVMLError when NVML is missing or cannot start (no driver)."""

    def __init__(self, fatal_xids: list[int]) -> None:
        import pynvml

        self.nv, self.fatal = pynvml, set(fatal_xids)
        pynvml.nvmlInit()
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        self.events = pynvml.nvmlEventSetCreate()
        for h in self.handles:
            try:
                pynvml.nvmlDeviceRegisterEvents(h, pynvml.nvmlEventTypeXidCriticalError, self.events)
            except pynvml.NVMLError:  # not supported on this GPU (e.g. some consumer boards)
                pass
        self.xid = 0

    def _drain_xids(self) -> None:
        nv = self.nv
        while True:
            try:
                data = nv.nvmlEventSetWait_v2(self.events, 0)
            except nv.NVMLError:  # NVML_ERROR_TIMEOUT: none waiting
                return
            if data.eventType == nv.nvmlEventTypeXidCriticalError and data.eventData in self.fatal:
                self.xid = int(data.eventData)

    def _read(self, fn, *args, default=0):
        try:
            return fn(*args)
        except self.nv.NVMLError:  # a counter this GPU does not have
            return default

    def sample(self) -> HealthSample:
        nv = self.nv
        self._drain_xids()
        ecc = remap = throttle = 0
        temp = power = clock = 0.0
        reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            nv.nvmlDeviceGetCurrentClocksThrottleReasons
        for h in self.handles:
            ecc += self._read(nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                              nv.NVML_VOLATILE_ECC)
            rows = self._read(nv.nvmlDeviceGetRemappedRows, h, default=(0, 0, 0, 0))
            remap |= int(bool(rows[3]))  # (corrected, uncorrected, pending, failure occurred)
            throttle |= self._read(reasons, h) & sum(THROTTLE_ALERTS)
            temp = max(temp, float(self._read(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU)))
            power = max(power, self._read(nv.nvmlDeviceGetPowerUsage, h) / 1000.0)
            clock = min(clock or float("inf"), float(self._read(nv.nvmlDeviceGetClockInfo, h, nv.NVML_CLOCK_SM)))
        return HealthSample(self.xid, int(ecc), remap, throttle, temp, power, 0.0 if clock == float("inf") else clock)

    def close(self) -> None:
        try:
            self.nv.nvmlEventSetFree(self.events)
            self.nv.nvmlShutdown()
        except self.nv.NVMLError:
            pass


def open_source(kind: str, device_type: str, fatal_xids: list[int], log) -> HealthSource | None:
    """The source `goodput.health.source` asks for: NVML (auto: on CUDA, when it starts), or None."""
    if kind == "off" or (kind == "auto" and device_type != "cuda"):
        return None
    try:
        return NvmlHealth(fatal_xids)
    except Exception as e:  # noqa: BLE001 - ImportError, or NVMLError without a driver
        if kind == "nvml":
            log(f"warning: goodput.health.source nvml could not start ({type(e).__name__}: {e}); "
                "install lmforge[gpu] (nvidia-ml-py) on a machine with NVIDIA's driver")
        return None


class HealthSampler:
    """Samples ``sources`` every ``interval_s`` seconds in a daemon thread; `latest` merges them (a
    fatal XID, once seen, stays)."""

    def __init__(self, sources: list[HealthSource], interval_s: float):
        self.sources, self.interval_s = sources, interval_s
        self._latest = HealthSample()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="lmforge-health", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self.poll()
            if self._stop.wait(self.interval_s):
                return

    def poll(self) -> HealthSample:
        samples = []
        for s in self.sources:
            try:
                samples.append(s.sample())
            except Exception:  # noqa: BLE001 - a failing read is no health event; the next one may work
                continue
        with self._lock:
            xid = self._latest.xid or next((x.xid for x in samples if x.xid), 0)
            self._latest = merge(samples, xid)
            return self._latest

    def latest(self) -> HealthSample:
        with self._lock:
            return self._latest

    def close(self) -> None:
        self._stop.set()
        for s in self.sources:
            s.close()


def merge(samples: list[HealthSample], xid: int = 0) -> HealthSample:
    """The worst of several sources' samples."""
    if not samples:
        return HealthSample(xid=xid)
    return HealthSample(xid=xid or max(s.xid for s in samples),
                        ecc_uncorrected=max(s.ecc_uncorrected for s in samples),
                        remap_failed=max(s.remap_failed for s in samples),
                        throttle=_or(s.throttle for s in samples),
                        temperature_c=max(s.temperature_c for s in samples),
                        power_w=max(s.power_w for s in samples),
                        sm_clock_mhz=max(s.sm_clock_mhz for s in samples))


def _or(values) -> int:
    out = 0
    for v in values:
        out |= v
    return out
