"""
What keeps an unattended run alive, so that train.py's loop stays about training: lease, signals, watchdog, events,
stragglers, bad steps, background checkpoints and the drills that rehearse them.

    python train.py --drill=spike@60,61,62 --ckpt_every=50        # a burst of spikes: rolled back
    python train.py --on_event='curl -d "$NANOTITAN_MESSAGE" ntfy.sh/my-run'
"""

import contextlib
import faulthandler
import importlib.util
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import checkpoint
import data
import parallel
from model import listed, max_vio, meta_model, suggest
from parallel import say


class Stopped(RuntimeError):
    """The run stopped itself (a burst of bad steps with no rollback left)."""


def restarts() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # 0: the job's first launch


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def stop(message: str, code: int = 1):
    """End this process at once from any thread: under torchrun the other ranks follow."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


# --- one live job per OUT_DIR: a lease renewed by a heartbeat (works on NFS and Lustre, unlike flock)

LEASE_BEAT_S = 2.0  # how often the holder renews it
LEASE_STALE_S = 10.0  # a heartbeat unchanged this long, by the newcomer's own clock: a job gone
LEASE_WAIT_S = 60.0  # how long a newcomer waits for a live holder before refusing


class Lease:
    """OUT_DIR/lease.json, held by rank 0 of the live job. Liveness is the heartbeat's age alone (a pid means nothing
    in another container); a restart of the same torchrun job takes its earlier launch's lease at once."""

    def __init__(self, out_dir: str):
        self.path = os.path.join(out_dir, "lease.json")
        job = os.environ.get("TORCHELASTIC_RUN_ID")
        self.mine = {"owner": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid(), "job": job,
                     "restart": restarts(), "beat": 0}
        seen = None
        since = start = time.monotonic()
        while not self.create():
            text, held = self.read()
            if text is None:  # given back since create() looked: claim it again
                continue
            earlier_launch = job is not None and held.get("job") == job and held.get("restart", math.inf) < restarts()
            if text != seen:  # first look, or the heartbeat moved: its job is alive
                seen = text
                since = time.monotonic()
            if time.monotonic() - since > LEASE_STALE_S or earlier_launch:
                self.write()
                time.sleep(0.5)  # a job that wrote at the same moment: the last write wins, the other one waits
                if self.read()[1].get("owner") == self.mine["owner"]:
                    why = "an earlier launch of this job" if earlier_launch else f"unchanged for {LEASE_STALE_S:g}s"
                    holder = f"host {held.get('host')} pid {held.get('pid')}" if held else "an unreadable lease"
                    say(f"lease of {out_dir} taken over from {holder}: {why}")
                    break
                continue
            if time.monotonic() - start >= LEASE_WAIT_S:
                raise ValueError(f"--out_dir={out_dir} is in use by another job (host {held.get('host')}, pid "
                                 f"{held.get('pid')}, heartbeat moving); stop it or choose another --out_dir.")
            time.sleep(0.5)
        self.renewed = time.monotonic()
        self.stopped = threading.Event()
        threading.Thread(target=self.renew, daemon=True).start()

    def create(self) -> bool:
        """Claim an absent lease: O_EXCL makes it atomic, so no wait is needed to see who won."""
        try:
            os.close(os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
        self.write()
        return True

    def read(self) -> tuple[str | None, dict]:
        """The lease's text (None: absent) and its fields ({}: garbage, which ages like any text)."""
        try:
            text = Path(self.path).read_text()
            held = json.loads(text)
        except FileNotFoundError:
            return None, {}
        except (OSError, UnicodeDecodeError) as e:
            return f"unreadable: {e}", {}
        except ValueError:
            return text, {}
        return text, held if isinstance(held, dict) else {}

    def write(self):
        self.mine["beat"] += 1
        data.write_durably(self.path, json.dumps(self.mine))

    def renew(self):
        where = os.path.dirname(self.path)
        while not self.stopped.wait(LEASE_BEAT_S):
            held = self.read()[1]
            if held.get("owner", self.mine["owner"]) != self.mine["owner"]:
                stop(f"lease of {where} taken over by host {held.get('host')} pid {held.get('pid')}: this job stops")
            try:
                self.write()
                self.renewed = time.monotonic()
            except OSError as e:  # a full disk may pass: retry, but stop before another job may judge us gone
                if time.monotonic() - self.renewed > LEASE_STALE_S / 2:
                    stop(f"lease of {where} not renewed for {LEASE_STALE_S / 2:g}s ({e.strerror or e}): this job stops "
                         f"before another one could take it over")

    def release(self):
        self.stopped.set()
        if self.read()[1].get("owner") == self.mine["owner"]:
            os.remove(self.path)


# --- what a person watching sees: the console, metrics.jsonl, status.json, --on_event

EVENT_TIMEOUT_S = 60  # an --on_event command still running after this long is killed
LOG_SINKS = ("tensorboard", "wandb")  # --log_to's choices, each its package's name


def log_sinks(log_to: str) -> list[str]:
    names = [] if log_to == "none" else listed(log_to)
    for name in names:
        if name not in LOG_SINKS:
            close = suggest(name, LOG_SINKS)
            raise ValueError(f"--log_to={log_to}: {name} is not one of none, {', '.join(LOG_SINKS)}"
                             + (f"; did you mean {close}?" if close else "."))
        if importlib.util.find_spec(name) is None:
            raise ValueError(f"--log_to={name} needs the {name} package, which is not installed here: pip install "
                             f"{name}")
    return names


class Events:
    """Rank 0 appends each step's record to metrics.jsonl (and TensorBoard, W&B) and rewrites status.json; a failed
    write (a full disk) is said once."""

    def __init__(self, out_dir: str, master: bool, log_to: list[str], command: str, resolved: dict):
        self.master = master
        self.out_dir = out_dir
        self.command = command
        self.log_to = log_to
        self.status = {"restarts": restarts()}
        self.pending = []  # events for the next record
        self.failed = set()  # the files whose write failed, said once each
        self.waiting = []
        self.lock = threading.Lock()  # an event may come from another thread (the watchdog)
        self.tensorboard = self.wandb = None
        self.metrics = Path(out_dir, "metrics.jsonl")
        if master and "wandb" in log_to:  # W&B's own variables (WANDB_PROJECT, WANDB_MODE) choose where it goes
            import wandb
            id_file = Path(out_dir, "wandb_run_id")
            self.wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "nanotitan"), dir=out_dir, config=resolved,
                                    id=id_file.read_text().strip() if id_file.exists() else None, resume="allow",
                                    allow_val_change=True)  # a restart may extend --steps
            id_file.write_text(self.wandb.id)
        if command:
            say(f"on each event: {command}")

    def rewind(self, step: int) -> int:
        """Forget the records after `step` (a resumed or rolled back run logs them again); returns how many."""
        forgotten = 0
        if self.master and self.metrics.exists():
            cut = Path(f"{self.metrics}.tmp")
            with self.metrics.open() as old, cut.open("w") as new:  # streamed: the file can be large
                for line in old:
                    with contextlib.suppress(ValueError, KeyError, TypeError):  # a record cut short by a crash: gone
                        if json.loads(line)["step"] <= step:
                            new.write(line)
                            continue
                    forgotten += 1
            cut.replace(self.metrics)
        if self.master and "tensorboard" in self.log_to:  # a new writer's purge_step hides the steps past `step`
            from torch.utils.tensorboard import SummaryWriter
            if self.tensorboard:
                self.tensorboard.close()
            self.tensorboard = SummaryWriter(os.path.join(self.out_dir, "tensorboard"), purge_step=step + 1)
        return forgotten

    def event(self, name: str, step: int, message: str):
        """Say `message`; rank 0 adds it to the next record and status.json, and runs --on_event."""
        say(message)
        if not self.master:
            return
        entry = {"name": name, "step": step, "message": message, "time": now()}
        self.pending.append(entry)
        self.update(last_event=entry)
        if self.command:
            env = {**os.environ, "NANOTITAN_EVENT": name, "NANOTITAN_STEP": str(step), "NANOTITAN_MESSAGE": message,
                   "NANOTITAN_OUT_DIR": self.out_dir}
            self.waiting.append(threading.Thread(target=self._run, args=(name, env), daemon=True))
            self.waiting[-1].start()

    def _run(self, name: str, env: dict):
        try:  # in its own session: torchrun tearing the job down does not kill the alert that says why
            proc = subprocess.Popen(self.command, shell=True, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
            failed = proc.wait(timeout=EVENT_TIMEOUT_S) and f"exit code {proc.returncode}"
        except OSError as e:
            failed = e.strerror
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            failed = f"killed after {EVENT_TIMEOUT_S}s"
        if failed:
            say(f"--on_event for {name} failed ({failed}); training goes on")

    def record(self, record: dict, **status):
        """Rank 0: append the step's record with the events since the last one; update status.json."""
        if not self.master:
            return
        if self.pending:
            record["events"] = self.pending
            self.pending = []
        self.write(self.metrics, json.dumps(record) + "\n", append=True)
        scalars = scalars_of({k: v for k, v in record.items() if k not in ("step", "events")})
        if self.tensorboard:
            for tag, value in scalars.items():
                self.tensorboard.add_scalar(tag, value, record["step"])
            self.tensorboard.flush()  # on disk at every record: a launch that dies keeps what it logged
        if self.wandb:
            self.wandb.log(scalars, step=record["step"])
        self.update(**status)

    def update(self, **numbers):
        if self.master:
            with self.lock:
                self.status.update(numbers, updated=now())
                self.write(Path(self.out_dir, "status.json"), json.dumps(self.status, indent=1) + "\n")

    def write(self, path: Path, text: str, append: bool = False):
        try:
            if append:
                with open(path, "a") as f:
                    f.write(text)
            else:
                data.write_durably(str(path), text)
            self.failed.discard(path.name)
        except OSError as e:
            if path.name not in self.failed:
                self.failed.add(path.name)
                say(f"{path} not written ({e.strerror or e}); training goes on")

    def close(self):
        for waiter in self.waiting:  # each command ends within EVENT_TIMEOUT_S
            waiter.join()
        if self.tensorboard:
            self.tensorboard.close()
        if self.wandb:
            import wandb
            self.wandb.finish()
            wandb.teardown()  # waits for W&B to write the run out: a torchrun worker leaves by os._exit


def scalars_of(record: dict, prefix: str = "") -> dict:
    """A record's numbers by dashboard tag: lists as KEY/00, KEY/01, ..., dicts as KEY/NAME."""
    scalars = {}
    for key, value in record.items():
        if isinstance(value, list):
            value = {f"{i:02d}": v for i, v in enumerate(value)}
        if isinstance(value, dict):
            scalars.update(scalars_of(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)):
            scalars[prefix + key] = value
    return scalars


# --- the bad-step policy: skip a spike, roll back a burst, stop past --max_rollbacks

SPREAD_FLOOR = 0.02  # the robust deviation of logs is at least 2%: values that barely vary trip nothing
DAMAGE_FACTOR = 10  # right after a load, a loss this many times further than a spike's limit: a damaged checkpoint


def spike_limits(recent: list, threshold: float) -> tuple[float, float]:
    """(loss, grad norm) limits: exp(median + threshold x 1.4826 x MAD) of the logs of `recent`. Gradient norms are
    heavy-tailed: on the log scale a limit is a factor of the typical value, which healthy steps stay within."""
    limits = []
    for values in zip(*recent):
        logs = [math.log(max(v, 1e-30)) for v in values]
        median = statistics.median(logs)
        deviation = 1.4826 * statistics.median(abs(v - median) for v in logs)
        limits.append(math.exp(median + threshold * max(deviation, SPREAD_FLOOR)))
    return tuple(limits)


class BadSteps:
    """Which steps are applied: a non-finite step or a spike changes nothing and its batch is skipped; a burst rolls
    back to the checkpoint before it (PaLM's recipe); a loss far beyond the limits after a load: a damaged one."""
    KEPT = ("skipped", "skipped_data", "recent", "spikes", "rollbacks")

    def __init__(self, tc, events: Events):
        self.tc = tc
        self.events = events
        self.skipped = 0  # steps skipped, in all
        self.skipped_data = []  # [start, end) windows of loader steps, sorted and disjoint
        self.recent = []  # [loss, grad norm] of the last applied steps
        self.spikes = []  # the recent bad steps' [step, data step]
        self.rollbacks = 0
        self.just_loaded = False  # the next step is the first after a checkpoint was loaded
        self.back_to = None  # after a burst or damage: (the newest step to load, why, event name, its data)
        self.bf16_since = None  # the first step of a burst in fp8 or mxfp8, after which the run trains in bf16

    def state_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.KEPT} | {"bf16_since": self.bf16_since}

    def load_state_dict(self, saved: dict, fresh_statistics: bool = False):
        for name in self.KEPT:
            setattr(self, name, saved[name])
        if self.bf16_since is None and saved.get("bf16_since") is not None:  # once in bf16, a run stays there
            self.bf16_since = saved["bf16_since"]
            if self.precision() == "bf16" and self.tc.precision != "bf16":
                say(f"training in bf16, not --precision={self.tc.precision}: a burst of bad steps from step "
                    f"{self.bf16_since + 1} left it (--keep_precision trains in {self.tc.precision} again)")
        if fresh_statistics:  # other data or tokenizer: the recorded losses say nothing of the new ones
            self.recent = []
        self.just_loaded = True

    def precision(self) -> str:
        return "bf16" if self.bf16_since is not None and not self.tc.keep_precision else self.tc.precision

    def data_step(self, step: int) -> int:
        """The (step + 1)-th loader step outside the skipped windows."""
        for start, end in self.skipped_data:
            if step >= start:
                step += end - start
        return step

    def skip_data(self, start: int, end: int):
        merged = []
        for window in sorted(self.skipped_data + [[start, end]]):
            if merged and window[0] <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], window[1])
            else:
                merged.append(list(window))
        self.skipped_data = merged

    def judge(self, step: int, data_step: int, loss: float, grad_norm: float) -> bool:
        """Whether step `step` is applied; a burst or damage sets back_to."""
        tc = self.tc
        full = tc.spike_threshold and len(self.recent) >= tc.spike_window
        limits = spike_limits(self.recent, tc.spike_threshold) if full else (math.inf, math.inf)
        just_loaded, self.just_loaded = self.just_loaded, False
        if just_loaded and tc.spike_threshold and self.recent:
            damaged_above = spike_limits(self.recent, DAMAGE_FACTOR * tc.spike_threshold)[0]
            if loss > damaged_above:  # the data is not to blame: nothing is skipped
                self.back_to = (step - 1, f"step {step + 1}, the first after loading the checkpoint of step {step}, "
                                f"has loss {loss:.4g} > {damaged_above:.4g}: that checkpoint looks damaged",
                                "damaged_checkpoint", None)
                return False
            limits = limits if full else (damaged_above, math.inf)
        if math.isfinite(loss) and math.isfinite(grad_norm) and loss <= limits[0] and grad_norm <= limits[1]:
            self.recent = (self.recent + [[loss, grad_norm]])[-tc.spike_window:]
            return True
        self.skipped += 1
        self.skip_data(data_step, data_step + 1)
        self.spikes = [s for s in self.spikes if s[0] > step - tc.spike_window] + [[step, data_step]]
        what = "non-finite" if not math.isfinite(loss + grad_norm) else "spike"
        self.events.event("spike", step + 1, f"step {step + 1}: {what} (loss {loss:.4g}, limit {limits[0]:.4g}; "
                          f"grad norm {grad_norm:.4g}, limit {limits[1]:.4g}); skipped with its batch (data step "
                          f"{data_step}), {len(self.spikes)} within {tc.spike_window} steps")
        if len(self.spikes) >= tc.spike_rollback:
            first_step, first_data = self.spikes[0]
            burst = f"{len(self.spikes)} bad steps within {tc.spike_window} steps, the first at step {first_step + 1}"
            if self.rollbacks >= tc.max_rollbacks:
                raise Stopped(f"{burst}, beyond --max_rollbacks={tc.max_rollbacks}; lower --lr or inspect data steps "
                              f"{first_data} to {data_step}, then resume")
            self.skip_data(first_data, data_step + 1)
            self.back_to = (first_step, burst, "rollback", (first_data, data_step))
            if tc.precision != "bf16" and not tc.keep_precision and self.bf16_since is None:
                self.bf16_since = first_step  # the same data in the same low precision would likely spike again
                self.events.event("precision", step + 1, f"{burst} in --precision={tc.precision}: the run goes back "
                                  f"in bf16 and stays there (--keep_precision keeps {tc.precision})")
        return False

    def rolled_back(self, loaded_step: int, kept: dict, path: str):
        """After back_to's checkpoint was loaded: carry the skipped data and counts over it."""
        _, why, name, skipped = self.back_to
        self.back_to = None
        if skipped is None:  # a damaged checkpoint
            self.events.event(name, loaded_step, f"{why}; fell back to {path}")
            return
        self.load_state_dict({**kept, "recent": self.recent, "rollbacks": kept["rollbacks"] + 1, "spikes": []})
        self.events.event(name, loaded_step, f"{why}: rolled back to {path} (rollback {self.rollbacks} of at most "
                                             f"{self.tc.max_rollbacks}); data steps {skipped[0]} to {skipped[1]} are "
                                             f"skipped")


# --- checkpoints written in the background, on a clock, at the end and on preemption

class Checkpoints:
    """One checkpoint written at a time, complete once every rank has written it; a failed one is said."""

    def __init__(self, tc, events: Events, master: bool, device: torch.device):
        self.tc = tc
        self.events = events
        self.master = master
        self.device = device
        self.root = os.path.join(tc.out_dir, "checkpoints")
        self.pending = None
        self.in_flight = False  # from a save's start until it is complete or failed
        self.started = time.time()
        self.step = 0
        self.final = False
        self.lost = None  # the final checkpoint's failure, raised once the run is wound up
        self.disk_low = False

    def due(self, step: int, applied: bool, requested: bool) -> tuple[bool, bool, bool]:
        """(save now, the last save is written, preempted), agreed in one all-reduce: a signal may reach some ranks
        only, and the clock is rank 0's."""
        tc = self.tc
        writing = self.pending is not None and not self.pending.done()
        clock = self.master and tc.ckpt_minutes > 0 and time.time() - self.started >= 60 * tc.ckpt_minutes
        flags = torch.tensor([requested, writing, clock], dtype=torch.float32, device=self.device)
        preempted, writing, clock = parallel.all_reduce_sum_(flags).tolist()
        every = applied and (step == tc.steps or (tc.ckpt_every and step % tc.ckpt_every == 0))
        return bool(every or preempted or clock), not writing, bool(preempted)

    def save(self, step: int, state: dict, resolved: dict, final: bool):
        self.wait()  # the previous write is complete before the next one starts
        self.step = step
        self.final = final
        self.started = time.time()
        self.in_flight = True
        try:
            self.pending = checkpoint.save(self.root, step, state, resolved, keep=self.tc.keep_ckpts, async_save=True)
        except checkpoint.SaveFailed as e:
            self.failed(e)

    def wait(self):
        """Complete the checkpoint in flight, if any (on every rank at the same step)."""
        if self.pending is None:
            return
        try:
            self.pending.wait()
        except checkpoint.SaveFailed as e:
            self.pending = None
            return self.failed(e)
        self.pending = None  # not on a second Ctrl-C in the wait: abandon() removes its files
        self.in_flight = False
        say(f"checkpoint step_{self.step:08d} complete, {time.time() - self.started:.1f}s after it began")
        self.events.update(last_checkpoint=checkpoint.latest(self.root))
        size = sum(f.stat().st_size for f in Path(self.root, f"step_{self.step:08d}").iterdir())
        free = shutil.disk_usage(self.tc.out_dir).free
        if free < 2 * size and not self.disk_low:
            self.events.event("disk_nearly_full", self.step, f"{self.tc.out_dir} has {free / 2**30:.2f} GiB free, "
                              f"under two checkpoints of {size / 2**30:.2f} GiB; free space or lower --keep_ckpts")
        self.disk_low = free < 2 * size

    def failed(self, e: checkpoint.SaveFailed):
        self.in_flight = False
        if self.final:  # nothing follows to go on with
            self.lost = e
        self.events.event("checkpoint_failed", self.step, str(e) if self.final else f"{e} Training goes on.")

    def abandon(self) -> str:
        """A second Ctrl-C: remove the checkpoint being written; what to say."""
        newest = checkpoint.latest(self.root) or "none"
        if not self.in_flight:
            return f"interrupted again: stopped at once; the newest checkpoint is {newest}"
        partial = checkpoint.abandon(self.root, self.step)
        return (f"interrupted again: checkpoint step_{self.step:08d} abandoned before it was complete (its partial "
                f"files {partial} removed); the newest checkpoint is {newest}")


# --- preemption signals, and a watchdog for hangs

class Watchdog:
    """SIGTERM, SIGUSR1 (Slurm, Kubernetes, spot reclaim) and SIGINT set `requested`: the loop checkpoints and exits 0.
    No step for --step_timeout seconds: a hang report, then exit 3."""

    def __init__(self, timeout_s: float, hang_dir: str, events: Events):
        self.requested = self.interrupted = False
        self.timeout_s = timeout_s
        self.hang_dir = hang_dir
        self.events = events
        self.last_beat = time.time()
        self.step = 0
        self.stopped = threading.Event()
        self.previous = {s: signal.signal(s, self.signal) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
        if timeout_s > 0:
            threading.Thread(target=self.watch, daemon=True).start()

    def signal(self, signum, frame):
        if signum == signal.SIGINT and self.interrupted:
            raise KeyboardInterrupt
        self.requested = True
        self.interrupted = self.interrupted or signum == signal.SIGINT

    def beat(self, step: int):
        self.last_beat = time.time()
        self.step = step

    def watch(self):
        while not self.stopped.wait(min(5.0, self.timeout_s / 4)):
            if time.time() - self.last_beat > self.timeout_s:
                stalled = f"watchdog: no step completed for {self.timeout_s:.0f}s after step {self.step}"
                print(f"{stalled}; stacks of every thread follow, then exit 3", file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                verdict = None
                try:
                    verdict = report_hang(self.hang_dir, self.step, self.timeout_s)
                except Exception as e:  # an unwritable OUT_DIR must not keep the process from exiting
                    print(f"watchdog: no hang report ({e})", file=sys.stderr, flush=True)
                self.events.event("hang", self.step, verdict or stalled)
                if verdict:  # rank 0 of several spoke: the others may exit
                    dist.distributed_c10d._get_default_store().set("hang/said", "1")
                stop("", 3)

    def close(self):
        """Give the signals back: train.main may run inside another program."""
        self.stopped.set()
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


# --- hang reports: each rank's last collectives and stacks; rank 0 names the ranks behind
# (torch's own analyser, torchfrtrace, reads NCCL's dumps but fails on gloo's in torch 2.13: this works on both)

def collectives() -> dict:
    """This rank's process groups and last collectives as the Flight Recorder saw them (entered > completed: it waits
    in collective `entered`)."""
    if not dist.is_initialized():
        return {}
    backend = dist.get_backend()
    # NCCL keeps its own recorder (CUDA builds); every other backend, gloo too, records into the generic one.
    dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace_json" if backend == "nccl" else "_dump_fr_trace_json",
                   None)
    if dump is None:
        return {"error": f"torch {torch.__version__} has no Flight Recorder for {backend}"}
    trace = json.loads(dump(True, False))
    status = trace.get("pg_status", {})
    groups = {}
    for group, name in dist.distributed_c10d._world.pg_names.items():
        seen = status.get(name, {})
        groups[name] = {"ranks": dist.get_process_group_ranks(group),
                        "entered": int(seen.get("last_enqueued_collective", -1)),
                        "completed": int(seen.get("last_completed_collective", -1))}
    last = [{"group": e["process_group"][0], "seq": e["collective_seq_id"], "op": e["profiling_name"],
             "sizes": e["input_sizes"]} for e in trace.get("entries", [])[-12:]]
    return {"groups": groups, "last": last}


def hang_verdict(records: dict[int, dict], world: int) -> str:
    """In each process group where a rank waits, the ranks that never entered that collective; the silent ranks."""
    def named(ranks) -> str:
        return ", ".join(f"rank {r}" + (f" ({records[r]['host']})" if r in records else "") for r in ranks)

    groups = {}  # (name, ranks) -> {rank: its view of the group}
    for rank, record in records.items():
        for name, group in record.get("groups", {}).items():
            groups.setdefault((name, tuple(group["ranks"])), {})[rank] = group
    found = []
    for (name, ranks), views in sorted(groups.items()):
        waiting = {r: v["entered"] for r, v in views.items() if v["entered"] > v["completed"]}
        seq = max(waiting.values(), default=-1)
        behind = [r for r in ranks if r in views and views[r]["entered"] < seq]
        if behind:
            op = next((e["op"] for r in waiting for e in records[r].get("last", [])
                       if e["group"] == name and e["seq"] == seq), "collective")
            waiters = [r for r in waiting if waiting[r] == seq]
            found.append(f"{named(behind)} never reached {op} #{seq} of process group {name} (ranks "
                         f"{', '.join(map(str, ranks))}), in which {named(waiters)} "
                         f"{'waits' if len(waiters) == 1 else 'wait'}")
    missing = [r for r in range(world) if r not in records]
    if missing:
        found.append(f"{named(missing)} sent no record (stuck holding the interpreter, or gone)")
    errors = {record["error"] for record in records.values() if "error" in record}
    return "hang: " + ("; ".join(found) or "no rank is behind another in a collective; read their stacks") + (
        f" ({'; '.join(errors)})" if errors else "")


def report_hang(hang_dir: str, step: int, timeout_s: float) -> str | None:
    """Write HANG_DIR/rank_NNNNN.txt; swap records through the job's store, which answers while collectives hang.
    Rank 0 returns hang_verdict's sentence."""
    rank, world = parallel.rank_world()
    record = {"host": socket.gethostname(), **collectives()}
    os.makedirs(hang_dir, exist_ok=True)
    with open(os.path.join(hang_dir, f"rank_{rank:05d}.txt"), "w") as f:
        f.write(f"rank {rank} of {world} on {record['host']}, pid {os.getpid()}: no step completed for "
                f"{timeout_s:.0f}s after step {step}\n")
        for name, group in record.get("groups", {}).items():
            f.write(f"process group {name} (ranks {group['ranks']}): the last collective entered is "
                    f"#{group['entered']}, the last completed #{group['completed']} (-1: none)\n")
        f.write("last collectives (process group, sequence number, operation, input sizes):\n")
        f.writelines(f"  {e['group']} #{e['seq']} {e['op']} {e['sizes']}\n" for e in record.get("last", []))
        f.write(f"{record.get('error', '')}\nstacks:\n")
        f.flush()
        faulthandler.dump_traceback(file=f, all_threads=True)
    if world == 1:
        return None
    store = dist.distributed_c10d._get_default_store()
    patience = timedelta(seconds=max(10.0, min(60.0, timeout_s)))  # the other ranks' watchdogs fire about together
    store.set(f"hang/{rank}", json.dumps(record))
    if rank != 0:
        with contextlib.suppress(Exception):  # rank 0 may be the one that cannot speak
            store.wait(["hang/said"], 2 * patience)
        return None
    keys = [f"hang/{r}" for r in range(world)]
    with contextlib.suppress(Exception):  # past it, the missing ranks are named
        store.wait(keys, patience)
    records = {r: json.loads(store.get(key)) for r, key in enumerate(keys) if store.check([key])}
    return f"{hang_verdict(records, world)}; each rank's stack and last collectives are in {hang_dir}/"


# --- drills: faults injected on purpose, each rehearsed on one machine

DRILLS = ("spike", "nan", "crash", "stall", "straggle", "skew")


def parse_drills(text: str) -> dict[str, list[float]]:
    """--drill's KIND@N[,N...] items by kind: "spike@7,9,10,nan@30" -> {"spike": [7, 9, 10], "nan": [30]}."""
    drills = {}
    kind = None
    for item in filter(None, (item.strip() for item in text.split(","))):
        kind, _, value = item.rpartition("@") if "@" in item else (kind, "", item)
        if kind not in DRILLS:
            raise ValueError(f"--drill={text}: {item!r} is not KIND@N with KIND one of {', '.join(DRILLS)}.")
        try:
            drills.setdefault(kind, []).append(float(value))
        except ValueError:
            raise ValueError(f"--drill={text}: {item!r} is not KIND@N with N a number, e.g. spike@60,61.") from None
    return drills


class Drills:
    """The faults --drill injects. Only a first launch dies or hangs: the restarted job finishes."""

    def __init__(self, text: str, rank: int, world: int, model):
        self.at = parse_drills(text)
        self.rank = rank
        self.doomed = restarts() == 0 and rank == world - 1  # the rank the crash and stall drills stop
        self.hook = None
        for moe in model.moe_layers() if "skew" in self.at else ():  # a resume loads the saved bias over it
            moe.expert_bias[: 2 * model.cfg.top_k] += self.at["skew"][0]

    def before_step(self, step: int, data_step: int, model, timeout_s: float):
        """spike and nan scale the loss the forward returns, so its gradients alike."""
        if step in self.at.get("crash", ()) and self.doomed:
            stop(f"crash drill: rank {self.rank} exits abruptly after step {step}")
        if step in self.at.get("stall", ()) and self.doomed:
            time.sleep(10 * timeout_s + 60)
        factor = math.nan if data_step in self.at.get("nan", ()) else 100.0 if data_step in self.at.get("spike", ()) \
            else None
        if factor is not None:
            self.hook = model.register_forward_hook(lambda module, args, out: (out[0] * factor, *out[1:]))

    def straggle(self, own_seconds: float):
        """At the end of the step's compute: a straggling rank sleeps its own time again."""
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
        if self.rank in self.at.get("straggle", ()):
            time.sleep(own_seconds)


# --- the console line, speed, stragglers and the run's summary

STEP_PARTS = ("data", "compute", "wait")
STRAGGLER_THRESHOLD = 0.2  # a rank whose own time per step is this much above the others' median is named
REPEATED_EPOCHS = 4  # past ~4 epochs of one source, repeats teach little (Muennighoff et al.): warned about


def slowest(times_RP: list[list[float]], hosts: list[str], threshold: float) -> tuple[dict, str | None]:
    """The record's per-rank seconds per step and how much the slowest rank's own time (data + compute) exceeds the
    others' median; past `threshold`, the sentence naming it."""
    record = {f"{part}_s_ranks": [round(t[p], 4) for t in times_RP] for p, part in enumerate(STEP_PARTS)}
    if len(times_RP) < 2:
        return record, None
    own_R = [data + compute for data, compute, _ in times_RP]
    rank = max(range(len(own_R)), key=own_R.__getitem__)
    others = [t for r, t in enumerate(times_RP) if r != rank]
    median = statistics.median(data + compute for data, compute, _ in others)
    slower = own_R[rank] / median - 1 if median > 0 else 0.0
    record.update(slowest_rank=rank, slowest_vs_median=round(slower, 4))
    if not threshold or slower <= threshold:
        return record, None
    data_s, compute_s, _ = times_RP[rank]
    wait = statistics.median(t[2] for t in others)
    return record, (f"straggler: rank {rank} on {hosts[rank]} takes {own_R[rank]:.3f}s per step of its own (data "
                    f"{data_s:.3f}s, compute {compute_s:.3f}s), {100 * slower:.0f}% above the other ranks' median of "
                    f"{median:.3f}s; they wait {wait:.3f}s per step for it")


class Meter:
    """Speed and each rank's time per step since the last log line; the run's summary."""

    def __init__(self, run, step: int):
        self.run = run
        self.flops_per_token = meta_model(run.cfg).flops_per_token(run.tc.seq_len)  # unsharded, on the meta device
        self.peak = parallel.peak_tflops(run.device)
        self.tokens_per_step = run.tc.global_batch * run.tc.seq_len
        self.start_step = self.logged_step = step
        self.t_start = self.t_last = time.time()
        self.first_loss = self.last = None
        self.repeated = set()  # sources said to be read more than REPEATED_EPOCHS times
        self.seconds_P = torch.zeros(len(STEP_PARTS), dtype=torch.float64)  # summed since the last log
        self.timed = 0
        self.hosts = parallel.gathered(socket.gethostname())  # a straggler is named with its host

    def add(self, *seconds: float):
        """This rank's seconds reading its batch, computing, and waiting for the slowest rank."""
        self.seconds_P += torch.tensor(seconds, dtype=torch.float64)
        self.timed += 1

    def log(self, step: int, lr: float, out: dict, model, alive) -> dict:
        """Say the console line; return the record's speed, memory, balance and per-rank time fields."""
        tc = self.run.tc
        dt = (time.time() - self.t_last) / (step + 1 - self.logged_step)  # the step synchronised the device
        self.t_last = time.time()
        self.logged_step = step + 1
        self.first_loss = out["lm_loss"] if self.first_loss is None else self.first_loss
        tok_s = self.tokens_per_step / dt
        mfu = tok_s * self.flops_per_token / (self.peak * 1e12 * self.run.layout.world) if self.peak else None
        mem = torch.cuda.max_memory_allocated(self.run.device) / 2**30 if self.run.device.type == "cuda" else None
        counts_LE = out["counts_LE"]
        per_layer = [max_vio(c) for c in counts_LE]
        times_RP = torch.zeros(len(self.hosts), len(STEP_PARTS), dtype=torch.float64, device=self.run.device)
        times_RP[self.run.rank] = self.seconds_P / max(self.timed, 1)
        parallel.all_reduce_sum_(times_RP)
        self.seconds_P.zero_()
        self.timed = 0
        # A launch's first step (compilation, cold caches) is recorded but not judged.
        threshold = STRAGGLER_THRESHOLD if step > self.start_step else 0.0
        times, straggler = slowest(times_RP.tolist(), self.hosts, threshold)
        eta = (time.time() - self.t_start) / (step + 1 - self.start_step) * (tc.steps - step - 1)
        say(f"step {step + 1:5d}/{tc.steps} | loss {out['loss']:.4f} | lr {lr:.2e} | grad {out['grad_norm']:.3f} | "
            f"{tok_s:,.0f} tok/s | mfu {'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | mem "
            f"{'n/a' if mem is None else f'{mem:.1f}GiB'} | maxvio {max(per_layer, default=0):.2f} | "
            f"eta {eta / 60:.1f}m")
        if straggler:
            alive.events.event("straggler", step + 1, straggler)
        alive.events.update(tokens_per_s=tok_s, mfu=mfu, eta_s=eta, tokens=(step + 1) * self.tokens_per_step)
        return {"tokens_per_s": tok_s, "mfu": mfu, "peak_mem_gib": mem, "skipped_steps": alive.bad_steps.skipped,
                "max_vio": max(per_layer, default=0.0), "max_vio_layers": [round(v, 4) for v in per_layer],
                "min_load_layers": counts_LE.min(-1).values.long().tolist(),
                "max_load_layers": counts_LE.max(-1).values.long().tolist(),
                "dead_experts_layers": (counts_LE == 0).sum(-1).tolist(),
                "bias_norm_layers": [round(m.expert_bias.norm().item(), 6) for m in model.moe_layers()], **times}

    def summary(self, state, alive) -> dict:
        """Say what the launch did (the "finished" event when the run is complete); return its losses."""
        tc = self.run.tc
        last = self.last or {}
        if last:
            val = round(last["val_loss"], 3) if "val_loss" in last else None
            summary = (f"done: {state.step - self.start_step} steps, {state.step * self.tokens_per_step:,} tokens in "
                       f"all, {time.time() - self.t_start:.0f}s; loss {self.first_loss:.3f} -> {last['loss']:.3f}, "
                       f"val loss {val}; outputs in {tc.out_dir}/")
            alive.events.event("finished", state.step, summary) if state.step == tc.steps else say(summary)
        if alive.checkpoints.lost:
            raise alive.checkpoints.lost
        return {"first_loss": self.first_loss, "loss": last.get("loss"), "val_loss": last.get("val_loss"),
                "step": state.step}

    def by_source(self, loader: data.DataLoader, data_step: int, loss_S: list[float]) -> dict:
        """The record's tokens, mean loss and epochs by source."""
        paths = loader.mixture.paths
        counts_S = loader.counts(data_step)
        epochs_S = loader.epochs(data_step)
        for path, epochs in zip(paths, epochs_S):
            if epochs > REPEATED_EPOCHS and path not in self.repeated:
                self.repeated.add(path)
                say(f"warning: {path} has been read {epochs:.2f} times (epochs): add data or lower its weight")
        return {"tokens_by_source": {path: int(n) * loader.seq_len for path, n in zip(paths, counts_S)},
                "loss_by_source": {path: loss / n for path, loss, n in zip(paths, loss_S, counts_S) if n},
                "epochs_by_source": {path: round(float(e), 4) for path, e in zip(paths, epochs_S)}}
