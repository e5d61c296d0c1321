"""HBM held by transfers in flight, bounded by what the start-up check counted.

On the ``device_put`` path a transfer holds HBM beyond staging until it
lands: a store's chunks sliced out of staging until their device-to-host
copy is done, a load's chunks sent to the device until its scatter is done.
Registration checked that staging plus ``in_flight_device_bytes`` (one more
staging buffer) fit in the HBM left free; nothing else bounded it, so a
device-to-host backlog could grow past it. The worker asks here before each
dispatch; one that would pass the bound waits for the oldest transfers to
land first (a store is never dropped: the scheduler's staging budget already
keeps one step's work within one staging buffer, so a wait only happens when
the device's copies fall behind the steps, and then it is the backpressure).
Bytes are per device. A bound of 0 (the ``program``
path: transfers run inside programs, no HBM outside staging) tracks nothing.
"""

from __future__ import annotations


class HbmInFlight:
    def __init__(self, bound: int):
        self.bound = bound
        self.held = 0
        self.peak = 0

    @property
    def enabled(self) -> bool:
        return self.bound > 0

    def fits(self, nbytes: int) -> bool:
        return self.held + nbytes <= self.bound

    def take(self, nbytes: int) -> int:
        self.held += nbytes
        self.peak = max(self.peak, self.held)
        return nbytes

    def release(self, nbytes: int) -> None:
        self.held = max(0, self.held - nbytes)
