"""Is the final checkpoint durable within the interruption notice? State size x bandwidth.

Run by hand: ``python benchmarks/bench_notice.py [SIZES] [MBPS]`` (default
``256MB,1GB`` and ``50,200``). For each state size S and simulated upload bandwidth B
(the local cloud's ``SPOTNB_LOCAL_UPLOAD_MBPS``, which every upload of an instance
shares), a job on the local cloud with EC2's real 120 s notice (``SPOTNB_LOCAL_NOTICE_
SECONDS=120``) holds S bytes of tensors and calls ``maybe_save`` every step; the
benchmark delivers a notice and reads, from the job's event log, the time from the
notice to the forced checkpoint's ``durable`` event. Two cases:

* ``idle link``: no save in flight when the notice comes (checkpoints every hour);
* ``save in flight``: a periodic save has just begun uploading when the notice comes
  (checkpoints every 10 steps), so the final save shares the link with it and
  commits after it: the worst moment for a notice.

The baseline, in the same run, is S / B: the bytes alone over the link. The verdict
compares the measurement with the notice period (120 s), and with the half of it that
spotnb's warning asks for (``spotnb.ckpt.notice.NOTICE_SHARE``). The last table
projects larger states from the measured overhead (measured time / (S / B)): a model,
not a measurement.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile

SIZES = sys.argv[1] if len(sys.argv) > 1 else "256MB,1GB"
MBPS = sys.argv[2] if len(sys.argv) > 2 else "50,200"
NOTICE = 120.0

CELL = """
import time
import torch
w = torch.ones(STATE_BYTES // 4)
ckpt = spot.Checkpoint(w=w)
for step in range(ckpt.restore(), 10**9):
    w[step % 1000] += 1.0
    spot.log(step, x=float(step))
    ckpt.maybe_save(step)
    time.sleep(0.05)
"""


def parse(size: str) -> int:
    return int(float(size[:-2]) * {"MB": 10**6, "GB": 10**9}[size[-2:].upper()])


def one(nbytes: int, mbps: float, in_flight: bool) -> tuple[float, bool]:
    """(notice -> durable seconds, whether a notice-fit warning was shown)."""
    import spotnb

    os.environ["SPOTNB_LOCAL_UPLOAD_MBPS"] = str(mbps)
    every = "10 steps" if in_flight else "1h"
    handle = spotnb.submit(CELL.replace("STATE_BYTES", str(nbytes)), checkpoint_every=every,
                           name=f"notice-{nbytes}-{mbps}")
    try:
        interrupted = durable_once = False
        notice = forced = None
        events = []
        for event in handle.events(timeout=1800):
            events.append(event)
            phase = event.data.get("phase") if event.type == "checkpoint" else None
            durable_once |= phase == "durable"
            # A notice comes at a random moment of a long run: well after the cell's
            # first steps (imports done), and, with a save in flight, while a periodic
            # save (not the first) uploads.
            ready = (phase == "begin" and durable_once) if in_flight else \
                (event.type == "metric" and event.data["step"] >= 40)
            if not interrupted and ready:
                handle.interrupt()
                interrupted = True
            if event.type == "instance" and event.data.get("action") == "notice":
                notice = event.time  # the group set the notice in the instance's IMDS
            if event.type == "checkpoint" and event.attempt == 1 and \
                    event.data.get("phase") == "durable" and event.data.get("forced"):
                forced = event.time
            if notice is not None and forced is not None:
                break
    finally:
        handle.stop()
    assert notice is not None and forced is not None
    warned = any(e.type == "warning" for e in events)
    return forced - notice, warned


def main() -> None:
    os.environ["SPOTNB_HOME"] = tempfile.mkdtemp(prefix="snb-bench-notice-")
    os.environ.update(SPOTNB_LOCAL_HAZARD="0", SPOTNB_LOCAL_BOOT_SECONDS="0",
                      SPOTNB_LOCAL_NOTICE_SECONDS=str(NOTICE))
    rows = []
    for size in SIZES.split(","):
        for mbps in (float(m) for m in MBPS.split(",")):
            for in_flight in (False, True):
                seconds, warned = one(parse(size), mbps, in_flight)
                rows.append((size, mbps, in_flight, seconds, warned))
                print(f"  {size} at {mbps:g} MB/s, {'save in flight' if in_flight else 'idle'}:"
                      f" {seconds:.1f} s", file=sys.stderr, flush=True)
    print(f"notice period {NOTICE:.0f} s; spotnb warns above {NOTICE / 2:.0f} s")
    print(f"{'state':>6} {'MB/s':>6} {'case':>15} {'S/B s':>7} {'notice->durable s':>18} "
          f"{'x S/B':>6} {'in notice':>10} {'warned':>7}")
    for size, mbps, in_flight, seconds, warned in rows:
        base = parse(size) / (mbps * 1e6)
        print(f"{size:>6} {mbps:6g} {'save in flight' if in_flight else 'idle link':>15} "
              f"{base:7.1f} {seconds:18.1f} {seconds / base:6.2f} "
              f"{'yes' if seconds <= NOTICE else 'NO':>10} {'yes' if warned else 'no':>7}")
    # The model: notice -> durable = k * S/B + c, per case, fitted on the measurements
    # (k is 1 with an idle link and 2 with a whole save in flight; c the fixed costs).
    print("\nprojection for larger states (a model fitted on the rows above, not a "
          "measurement): notice -> durable, and whether it is within the 120 s notice")
    fits = {}
    for in_flight in (False, True):
        pts = [(parse(z) / (m * 1e6), s) for z, m, f, s, _ in rows if f == in_flight]
        k = 2.0 if in_flight else 1.0
        fits[in_flight] = (k, statistics.median(s - k * x for x, s in pts))
        print(f"  {'save in flight' if in_flight else 'idle link'}: {k:.0f} x S/B + "
              f"{fits[in_flight][1]:.1f} s")
    grid_mbps = (100, 250, 500, 1000)
    print(f"{'state':>6} " + " ".join(f"{m:>17} MB/s" for m in grid_mbps))
    for gb in (1, 4, 8, 16, 24, 50):
        cells = []
        for m in grid_mbps:
            base = gb * 1e9 / (m * 1e6)
            t_idle = fits[False][0] * base + fits[False][1]
            t_busy = fits[True][0] * base + fits[True][1]
            verdict = "yes" if t_busy <= NOTICE else ("idle only" if t_idle <= NOTICE else "no")
            cells.append(f"{t_idle:5.0f}-{t_busy:<5.0f}s {verdict:>9}")
        print(f"{gb:>4}GB " + " ".join(cells))

if __name__ == "__main__":
    main()
