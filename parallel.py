"""
Parallelism applied in place to the plain model of model.py (HSDP, expert and context parallelism, activation
checkpointing, per-block torch.compile), and the optimizer (AdamW, or Muon on sharded matrices). One DeviceMesh
[dp_replicate, efsdp, cp, ep], ep innermost (an EP group is consecutive ranks): dense parameters FSDP-sharded over
efsdp x cp x ep, routed experts split E/ep per EP rank and sharded over efsdp x cp, both replicated over
dp_replicate. The cp ranks of a group hold contiguous chunks of the same rows (attention: all-to-all over cp).

    torchrun --standalone --nproc_per_node=8 train.py --dp_replicate=2 --ep=4   # train.py applies it
    python -m pytest tests/test_parallel.py tests/test_muon.py -q              # 8 and 2 CPU ranks vs one process

Shape letters as in model.py, plus: M (token, expert) pairs sorted by expert, P EP peers, L local experts (E / ep),
R tokens received from the EP peers; for Muon, X matrices in a batch, each O x F (fan-out x fan-in), Q x W wide.
"""

import contextlib
import ctypes
import dataclasses
import functools
import gc
import importlib.util
import math
import os
import signal
import sys
import time
import uuid
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as ckpt
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.optim.adamw import adamw

from model import Attention, GroupedExperts, ModelConfig, MoE, Transformer, attend, expert_ffn, meta_model

AC_MODES = ("none", "full", "selective")
OPTIMIZERS = ("adamw", "muon")


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard (the DTensor's own storage, so in-place updates reach the parameter), or t itself."""
    return t.to_local() if isinstance(t, DTensor) else t


# --- Process group

def host_memory_available() -> int | None:
    """What new allocations can take without swapping (the kernel's MemAvailable), in bytes; None without /proc."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


def check_host_memory(model: nn.Module, copies: int, what: str = "the weights, gradients and optimizer state"):
    """Refuse a CPU model whose weights times `copies`, on each of this machine's ranks, exceed its available memory
    (else the OOM killer ends the run without a word). A lower bound: activations are not counted."""
    available = host_memory_available()
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    need = copies * sum(t.numel() * t.element_size() for t in map(local, model.parameters()))
    if available is not None and need * ranks > available:
        raise ValueError(f"{what} need {need / 2**30:.1f} GiB on each of this machine's {ranks} rank(s) but only "
                         f"{available / 2**30:.1f} GiB of memory is available; choose a smaller model, or more "
                         f"machines or GPUs.")


def use_cuda() -> bool:
    """Whether to compute on a GPU: NANOTITAN_DEVICE=cpu or cuda says so; unset (or auto): where one is visible."""
    choice = os.environ.get("NANOTITAN_DEVICE", "auto")
    if choice not in ("auto", "cpu", "cuda"):
        raise ValueError(f"NANOTITAN_DEVICE={choice} is not one of auto, cpu, cuda; unset it or pick one.")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ValueError("NANOTITAN_DEVICE=cuda but torch sees no CUDA GPU; unset it (or set cpu).")
    return choice == "cuda" or (choice == "auto" and torch.cuda.is_available())


def init_distributed(timeout_s: int = 600, used: int | None = None) -> tuple[int, int, torch.device]:
    """(rank, world size, device). Under torchrun: NCCL on CUDA (a GPU per LOCAL_RANK) or gloo, with a collective
    timeout, over the first `used` ranks (default: all; the others stand by). Else one process."""
    cuda = use_cuda()
    if not cuda:
        # glibc returns freed blocks over 32 MiB to the OS, which zero-fills them afresh next step (a quarter of an
        # MoE layer's CPU time): keep blocks under 1 GiB for reuse (M_MMAP_ and M_TRIM_THRESHOLD).
        with contextlib.suppress(OSError, AttributeError):
            for option in (-3, -1):
                ctypes.CDLL("libc.so.6").mallopt(option, 1 << 30)
        # torch runs a thread per core; on busy cores its threads wait for each other (on 2 busy cores: a tiny step
        # 29 s with 2 threads, 3 s with 1). torchrun already gives each of N > 1 ranks one.
        threads = torch.get_num_threads()
        with contextlib.suppress(OSError, AttributeError):  # the load average: Unix only
            if threads > 1 and os.getloadavg()[0] > threads:
                print(f"warning: the CPU is busy (load {os.getloadavg()[0]:.1f} on {threads} threads), so one thread "
                      f"may run faster; set OMP_NUM_THREADS=1", file=sys.stderr)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 1, torch.device("cuda" if cuda else "cpu")
    if "TORCHELASTIC_RUN_ID" in os.environ and sys.platform == "linux":
        # A worker outliving its launcher would train beside the relaunched job: PR_SET_PDEATHSIG kills it with it.
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)
        if os.getppid() == 1:  # the launcher died before the line above
            os._exit(1)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    used = world if used is None else used
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK={local_rank} but this node has {torch.cuda.device_count()} visible GPUs; "
                               f"lower --nproc_per_node.")
        torch.cuda.set_device(device)
    if not {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"} & set(os.environ):
        # torch's Flight Recorder: each group's last 2,000 collectives, for train.py's hang report.
        os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"
    global _store
    timeout = timedelta(seconds=timeout_s)
    _store = _round_store(rank, world, timeout)
    if rank >= used:
        standby(rank, world, used)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout,
                            device_id=device if cuda else None, store=_store, rank=rank, world_size=used)
    return rank, used, device


_store = None  # this round's store: rank 0 hosts it, the other ranks are its clients
ROUND_KEY = "/nanotitan/round_store"  # in torchrun's store: "port nonce" of this round's store


def _round_store(rank: int, world: int, timeout: timedelta) -> dist.Store:
    """A store of this round's ranks alone: torchrun (torch >= 2.5) keeps one store across restarts, where a new
    round would read a dead round's keys. Rank 0 hosts a fresh one and writes its port and a nonce there; the others
    connect to the port written last until one answers that nonce."""
    host = os.environ["MASTER_ADDR"]
    port = int(os.environ["MASTER_PORT"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # the port is ours: rank 0 hosts the store there
        return dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    agent = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    if rank == 0:
        store = dist.TCPStore(host, 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        nonce = uuid.uuid4().hex
        store.set("nonce", nonce)
        agent.set(ROUND_KEY, f"{store.port} {nonce}")
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while time.monotonic() < deadline:
        port, nonce = agent.get(ROUND_KEY).decode().split()  # waits for the first round's rank 0
        with contextlib.suppress(RuntimeError):  # refused or timed out (DistStoreError is a RuntimeError)
            store = dist.TCPStore(host, int(port), world, is_master=False, timeout=timedelta(seconds=2))
            if store.check(["nonce"]) and store.get("nonce").decode() == nonce:
                store.set_timeout(timeout)
                return store
        time.sleep(0.2)
    raise RuntimeError(f"rank {rank} found no store of this round's rank 0 on {host} within {timeout}.")


def standby(rank: int, world: int, used: int):
    """A rank beyond a whole number of replicas: no model, no collective, until the job ends (rank 0's store says
    so, or is gone) or torchrun restarts it."""
    print(f"rank {rank} stands by: the first {used} of {world} ranks train; it is used at the next restart", flush=True)
    with contextlib.suppress(RuntimeError):  # rank 0, and with it the round, is gone: torchrun decides what follows
        while not _store.check(["done"]):
            time.sleep(1)
    os._exit(0)


def finish(code: int) -> int:
    """Collect the cycles holding process groups while the interpreter is whole; leave a torchrun worker without
    interpreter shutdown (gloo's leftovers can abort a run that succeeded). Standing-by ranks end with it."""
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    if "RANK" in os.environ:
        if _store is not None:
            with contextlib.suppress(RuntimeError):
                _store.set("done", str(code))
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)
    return code


def rank_world() -> tuple[int, int]:
    """(rank, number of ranks): (0, 1) without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def say(*args, **kwargs):
    """print on rank 0 only."""
    if rank_world()[0] == 0:
        print(*args, **kwargs)


def gathered(value) -> list:
    """Every rank's `value` in rank order, on every rank."""
    values = [value] * rank_world()[1]
    if len(values) > 1:
        dist.all_gather_object(values, value)
    return values


def all_reduce_sum_(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over all ranks, in place (a no-op in one process)."""
    if rank_world()[1] > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


# --- Layout and mesh

def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclasses.dataclass
class Layout:
    """`world` ranks as dp_replicate replicas of an FSDP group of dp_shard x cp ranks: dp_shard ranks read different
    rows, each as cp ranks holding a contiguous 1/cp of each row's tokens; EP groups of ep ranks."""
    world: int
    dp_replicate: int = 1
    ep: int = 1
    cp: int = 1

    @classmethod
    def for_world(cls, launched: int, dp_replicate: int, dp_shard: int, ep: int, cp: int = 1) -> "Layout":
        """The layout of `launched` ranks (dp_shard 0: launched / dp_replicate / cp). dp_replicate=0 (auto): as many
        replicas as fit, following an elastic job's world; the rest stand by."""
        group = dp_shard * cp
        x_cp = f" x --cp={cp}" if cp > 1 else ""
        if dp_replicate == 0:
            if dp_shard == 0:
                raise ValueError("--dp_replicate=auto needs --dp_shard, the FSDP group size to keep.")
            if launched < group:
                raise ValueError(f"{launched} ranks cannot hold --dp_shard={dp_shard}{x_cp}; launch more or lower it.")
            return cls(launched // group * group, launched // group, ep, cp)
        if dp_shard and dp_replicate * group != launched:
            raise ValueError(f"--dp_replicate={dp_replicate} x --dp_shard={dp_shard}{x_cp} is {dp_replicate * group} "
                             f"ranks but {launched} were launched; launch that many or use --dp_replicate=auto.")
        return cls(launched, dp_replicate, ep, cp)

    @property
    def dp_shard(self) -> int:
        return self.world // self.dp_replicate // self.cp

    @property
    def dp(self) -> int:
        """Ranks reading different rows of the global batch (a cp group reads the same rows)."""
        return self.world // self.cp

    def data_rank(self, rank: int) -> tuple[int, int]:
        """(the dp row block rank `rank` reads, the cp chunk of each row it holds), in build_mesh's order."""
        return rank // (self.cp * self.ep) * self.ep + rank % self.ep, rank // self.ep % self.cp

    @property
    def efsdp(self) -> int:
        return self.dp_shard // self.ep

    def check(self, model_cfg: ModelConfig, global_batch: int, micro_batch: int):
        """Raise ValueError, one sentence, if this layout cannot train `model_cfg` on `global_batch` sequences in
        micro-batches of `micro_batch`: on every rank alike, before any collective."""
        W, R, ep, cp = self.world, self.dp_replicate, self.ep, self.cp  # each >= 1 (TrainConfig's rules)
        launched = rank_world()[1]
        if dist.is_available() and dist.is_initialized() and launched != W:
            raise ValueError(f"Layout(world={W}) does not match {launched} launched processes; pass world={launched}.")
        if W % R:
            raise ValueError(f"world size {W} is not divisible by dp_replicate={R}; choose from {divisors(W)}.")
        if W % (R * cp):
            raise ValueError(f"world size {W} is not divisible by dp_replicate={R} x cp={cp}; choose cp from "
                             f"{divisors(W // R)}.")
        if model_cfg.n_kv_heads % cp:  # attention gives each cp rank whole sequences for 1/cp of the heads
            raise ValueError(f"cp={cp} does not divide n_kv_heads={model_cfg.n_kv_heads}: choose cp from "
                             f"{divisors(model_cfg.n_kv_heads)}.")
        S = self.dp_shard
        if S % ep:  # an EP group would straddle two FSDP groups
            raise ValueError(f"ep={ep} does not divide dp_shard={S} (world {W} / dp_replicate {R}"
                             + (f" / cp {cp}" if cp > 1 else "") + f"); choose ep from {divisors(S)}.")
        if model_cfg.n_experts % ep:
            raise ValueError(f"n_experts={model_cfg.n_experts} is not divisible by ep={ep}; choose ep from "
                             f"{[d for d in divisors(S) if model_cfg.n_experts % d == 0]}.")
        if ep > 1 and model_cfg.n_dense_layers >= model_cfg.n_layers:
            raise ValueError(f"ep={ep} but the model has no MoE layer; use ep=1.")
        n = self.dp * micro_batch
        if global_batch % n:
            rows = f"world {W}" if cp == 1 else f"world {W} / cp {cp}"
            raise ValueError(f"global_batch={global_batch} sequences is not divisible by {rows} x micro_batch "
                             f"{micro_batch} = {n}; make global_batch a multiple of {n}.")

    def accumulation_steps(self, global_batch: int, micro_batch: int) -> int:
        return global_batch // (self.dp * micro_batch)

    def describe(self, n_experts: int | None = None) -> str:
        """Which ranks form each FSDP group, replica and EP group, and where the experts live."""
        W = self.world
        R, F, cp, ep = self.dp_replicate, self.efsdp, self.cp, self.ep  # the mesh's shape
        if W == 1:
            return "1 process: no data or expert parallelism."

        def shown(g: list[int]) -> str:  # "0-3", "0,4", "0,4,...,28"
            if len(g) > 1 and g == list(range(g[0], g[-1] + 1)):
                return f"{g[0]}-{g[-1]}"
            return f"{g[0]},{g[1]},...,{g[-1]}" if len(g) > 4 else ",".join(map(str, g))
        ranks = torch.arange(W).view(R, F, cp, ep)  # row-major, as init_device_mesh lays ranks out
        x_cp = f" x cp={cp}" if cp > 1 else ""
        lines = [f"mesh [dp_replicate={R}, efsdp={F}, {f'cp={cp}, ' if cp > 1 else ''}ep={ep}] over {W} ranks"]
        for wanted, name, grid in (
                (True, f"FSDP groups (dense params, dp_shard={self.dp_shard}{x_cp})", ranks.reshape(R, -1)),
                (R > 1, f"replicas (dp_replicate={R}, dense and experts)", ranks.permute(1, 2, 3, 0)),
                (ep > 1, f"EP groups (ep={ep}, consecutive ranks)", ranks),
                (cp > 1, f"CP groups (cp={cp}, the chunks of a row)", ranks.transpose(2, 3)),
                (F * cp > 1, f"expert FSDP groups (efsdp={F}{x_cp})", ranks.permute(0, 3, 1, 2).reshape(R, ep, -1))):
            groups = grid.reshape(-1, grid.shape[-1]).tolist()
            if wanted:
                lines.append(f"  {name}: " + " ".join(f"[{shown(g)}]" for g in groups[:3])
                             + (f" ... ({len(groups)} groups)" if len(groups) > 3 else ""))
        if n_experts is not None:
            per_gpu = n_experts / ep / F / cp
            lines.append(f"  routed experts: {n_experts}/{ep} = {n_experts // ep} per EP rank, {per_gpu:g} per GPU"
                         + ("" if per_gpu.is_integer() else " (uneven FSDP shards)"))
        return "\n".join(lines)


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh | None:
    """The mesh [dp_replicate, efsdp, cp, ep] plus the flattened dims "dp_shard" = (efsdp, cp, ep), the dense
    parameters' FSDP group, and "efsdp_cp" = (efsdp, cp), the routed experts'; None in one process."""
    if layout.world == 1:
        return None
    if not dist.is_initialized():
        raise RuntimeError(f"Layout(world={layout.world}) needs {layout.world} processes: launch with torchrun and "
                           f"call init_distributed() first.")
    mesh = init_device_mesh(device_type, (layout.dp_replicate, layout.efsdp, layout.cp, layout.ep),
                            mesh_dim_names=("dp_replicate", "efsdp", "cp", "ep"))
    mesh["efsdp", "cp", "ep"]._flatten("dp_shard")
    mesh["efsdp", "cp"]._flatten("efsdp_cp")
    return mesh


def _submesh(mesh: DeviceMesh, *names: str) -> DeviceMesh:
    """mesh[names] with flattened dims among them (torch 2.13 warns this will go away)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return mesh[names]


# --- The model, parallelized: expert parallelism, FSDP2, activation checkpointing, compile

class ExpertParallelExperts(GroupedExperts):
    """This EP rank's E/ep experts; forward sends each token to its expert's rank and back. The weights are DTensors,
    Shard(0) over "ep": the plain model's shapes and names, which DCP can reshard to any layout."""

    def __init__(self, experts: GroupedExperts, ep_mesh: DeviceMesh):
        nn.Module.__init__(self)  # not GroupedExperts.__init__: that would allocate all E experts
        self.impl = experts.impl
        self.ep_mesh = ep_mesh
        ep = ep_mesh.size()
        me = ep_mesh.get_local_rank()
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(experts, name)
            mine = full.detach().chunk(ep)[me].clone()  # contiguous experts me*L .. (me+1)*L-1 (free on meta)
            dtensor = DTensor.from_local(mine, ep_mesh, [Shard(0)], run_check=False, shape=full.shape,
                                         stride=full.stride())
            setattr(self, name, nn.Parameter(dtensor, requires_grad=full.requires_grad))

    def forward(self, x_MD, counts_E, scale_M):
        ep = self.ep_mesh.size()
        # Counts first: row p of send_counts_PL is what we send peer p, per expert of p; row p of recv_counts_PL
        # what peer p sends us, per local expert.
        send_counts_PL = counts_E.view(ep, -1)
        recv_counts_PL = funcol.all_to_all_single(send_counts_PL.flatten(), None, None, self.ep_mesh).view(ep, -1)
        send_splits, recv_splits = torch.stack([send_counts_PL.sum(1), recv_counts_PL.sum(1)]).tolist()  # host sync
        # Then the tokens, in uneven splits (the backward is the reverse all-to-all).
        x_RD = funcol.all_to_all_single_autograd(x_MD, recv_splits, send_splits, self.ep_mesh)
        scale_R = funcol.all_to_all_single_autograd(scale_M, recv_splits, send_splits, self.ep_mesh)
        # They arrive grouped by (peer, local expert); expert_ffn wants them grouped by local expert.
        L = recv_counts_PL.shape[1]
        expert_R = torch.arange(L, device=x_MD.device).repeat(ep).repeat_interleave(
            recv_counts_PL.flatten(), output_size=sum(recv_splits))
        order_R = torch.argsort(expert_R, stable=True)
        y_RD = expert_ffn(x_RD.index_select(0, order_R), recv_counts_PL.sum(0), self.gate_up_proj.to_local(),
                          self.down_proj.to_local(), self.impl, scale_R.index_select(0, order_R))
        y_RD = torch.zeros_like(y_RD).index_copy(0, order_R, y_RD)  # back to arrival order, then to the senders
        return funcol.all_to_all_single_autograd(y_RD, send_splits, recv_splits, self.ep_mesh)


def apply_ep(model: Transformer, mesh: DeviceMesh):
    """Split every MoE layer's routed experts over the "ep" mesh dim (E/ep per rank)."""
    for moe in model.moe_layers():
        moe.experts = ExpertParallelExperts(moe.experts, mesh["ep"])


class ContextParallel:
    """Context parallelism by all-to-all (Ulysses): each of a cp group's `size` ranks holds a contiguous 1/size of
    each sequence's tokens, except inside attention, where it holds whole sequences for 1/size of the heads (q and kv
    split alike, keeping GQA pairs together), so any kernel and mask work unchanged."""

    def __init__(self, cp_mesh: DeviceMesh):
        self.mesh = cp_mesh
        self.size = cp_mesh.size()
        self.rank = cp_mesh.get_local_rank()

    def gather(self, x_BT: torch.Tensor) -> torch.Tensor:
        """The whole sequences [B, size * T] of a per-token tensor without gradient (document ids)."""
        chunks = [torch.empty_like(x_BT) for _ in range(self.size)]
        dist.all_gather(chunks, x_BT.contiguous(), group=self.mesh.get_group())
        return torch.cat(chunks, 1)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the cp group, without gradient; compiled blocks trace it."""
        return funcol.all_reduce(x, "sum", self.mesh)

    def _to_heads(self, x_BHTDh: torch.Tensor) -> torch.Tensor:
        """[B, H, T, Dh], this rank's tokens of every head -> [B, H/size, size*T, Dh], every token of its heads."""
        B, H, T, Dh = x_BHTDh.shape
        send_PBhTDh = x_BHTDh.reshape(B, self.size, H // self.size, T, Dh).transpose(0, 1).contiguous()
        recv_PBhTDh = funcol.all_to_all_single_autograd(send_PBhTDh, None, None, self.mesh)
        return recv_PBhTDh.permute(1, 2, 0, 3, 4).reshape(B, H // self.size, self.size * T, Dh)

    def _to_tokens(self, o_BhSDh: torch.Tensor) -> torch.Tensor:
        """The reverse of _to_heads: [B, H/size, size*T, Dh] -> [B, H, T, Dh]."""
        B, h, S, Dh = o_BhSDh.shape
        send_PBhTDh = o_BhSDh.view(B, h, self.size, S // self.size, Dh).permute(2, 0, 1, 3, 4).contiguous()
        recv_PBhTDh = funcol.all_to_all_single_autograd(send_PBhTDh, None, None, self.mesh)
        return recv_PBhTDh.transpose(0, 1).reshape(B, h * self.size, S // self.size, Dh)

    def attend(self, q_BHTDh, k_BGTDh, v_BGTDh, mask):
        """model.attend over whole sequences (mask: theirs), for this rank's tokens."""
        o_BhSDh = attend(self._to_heads(q_BHTDh), self._to_heads(k_BGTDh), self._to_heads(v_BGTDh), mask)
        return self._to_tokens(o_BhSDh)


def apply_cp(model: Transformer, mesh: DeviceMesh):
    """Split every sequence over the "cp" mesh dim: the model, its attention layers and MoE balance losses."""
    context = ContextParallel(mesh["cp"])
    for module in model.modules():
        if isinstance(module, (Transformer, Attention, MoE)):
            module.seq_parallel = context


def apply_fsdp(model: Transformer, mesh: DeviceMesh, param_dtype: torch.dtype | None = None):
    """fully_shard each block and the root over (dp_replicate, dp_shard x cp), routed experts over (dp_replicate,
    efsdp x cp): a cp rank's gradients (other tokens of the same rows) are summed like another rank's rows'."""
    replicas = ("dp_replicate",) if mesh["dp_replicate"].size() > 1 else ()
    dense_mesh = _submesh(mesh, *replicas, "dp_shard")
    expert_mesh = _submesh(mesh, *replicas, "efsdp_cp")
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.layers.values():
        if isinstance(block.ffn, MoE):
            experts = fully_shard(block.ffn.experts, mesh=expert_mesh, mp_policy=mp)
            # FSDP divides by its mesh (world / ep ranks), but an expert's gradient already sums all ep peers'
            # tokens (the all-to-all backward): dividing by the world gives the global-batch mean, as dense.
            experts.set_gradient_divide_factor(float(mesh.size()))
            if mesh.device_type == "cpu" and mesh["efsdp"].size() * mesh["cp"].size() > 1:
                # A custom factor reduce-scatters with PREMUL_SUM, which gloo lacks: sum, then divide. (Not with a
                # single-rank efsdp: there torch 2.13 divides once in the copy and again after the sum.)
                experts.set_force_sum_reduction_for_comms(True)
        fully_shard(block, mesh=dense_mesh, mp_policy=mp)
    fully_shard(model, mesh=dense_mesh, mp_policy=mp)


def _ops(*names: str) -> set:
    """The named ops this torch build has (attention kernels and collectives vary by version)."""
    found = set()
    for namespace, op, overload in (name.split(".") for name in names):
        packet = getattr(getattr(torch.ops, namespace, None), op, None)
        if packet is not None and hasattr(packet, overload):
            found.add(getattr(packet, overload))
    return found


# Selective AC keeps matmul and attention outputs and the EP and CP collectives', so recompute issues no collective.
_SAC_SAVE = _ops(*(f"aten.{op}.default" for op in (
    "mm", "addmm", "bmm", "_grouped_mm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention")),
    "_c10d_functional.all_to_all_single.default", "_c10d_functional_autograd.all_to_all_single.default",
    "_c10d_functional.all_reduce.default")
if hasattr(torch._higher_order_ops, "flex_attention"):
    _SAC_SAVE.add(torch._higher_order_ops.flex_attention)


def _sac_policy(ctx, op, *args, **kwargs):
    return ckpt.CheckpointPolicy.MUST_SAVE if op in _SAC_SAVE else ckpt.CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: Transformer, mode: str):
    """"full": recompute every block in backward; "selective": all but matmuls and collectives. Each block's
    forward is wrapped in place (no wrapper module), so state-dict names do not change."""
    if mode == "none":
        return
    context_fn = ckpt.noop_context_fn
    if mode == "selective":
        context_fn = functools.partial(ckpt.create_selective_checkpoint_contexts, _sac_policy)
        # SAC replays the region's ops by count, but the experts' FSDP hooks inside the block call profiler
        # annotations a different number of times in forward and in recompute (torch 2.13).
        ckpt.SAC_IGNORED_OPS.update(_ops("profiler._record_function_enter_new.default",
                                    "profiler._record_function_exit._RecordFunction"))
    for block in model.layers.values():
        block.forward = functools.partial(ckpt.checkpoint, block.forward, use_reentrant=False, context_fn=context_fn)


def apply_compile(model: Transformer, backend: str = "inductor"):
    """torch.compile each block in place (state-dict names kept). The EP all-to-all needs host-side split sizes, so
    a MoE block compiles as a few graphs around it."""
    # Block.forward compiles per block kind, grad mode and shape: past dynamo's default 8 variants it runs eager.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    for block in model.layers.values():
        block.compile(backend=backend)


# --- Low precision: the blocks' matmuls in FP8 or MXFP8 through torchao, switchable in place

PRECISIONS = ("bf16", "fp8", "mxfp8")
# Each converted matmul's reduction dims (widths; tokens for the weight gradient) must be a multiple of this: fp8's
# scaled GEMMs need 16, MXFP8 scales blocks of 32 values.
ALIGN = {"fp8": 16, "mxfp8": 32}


class LowPrecision(torch.overrides.TorchFunctionMode):
    """Inside a converted module's forward, F.linear (or the experts' grouped GEMM, MXFP8) runs as torchao's FP8
    (rowwise) or MXFP8 matmul, forward and backward, on fp32 master weights cast per call; on CPU torchao emulates
    them. The experts' per-expert loop (no grouped GEMM) stays in high precision."""

    def __init__(self, precision: str, device: torch.device, experts: bool):
        super().__init__()
        self.precision = precision
        self.align = ALIGN[precision]
        self.experts = experts
        emulate = device.type != "cuda"
        if precision == "fp8":
            from torchao.float8 import Float8LinearConfig
            from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
            from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig
            c = dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), emulate=emulate)
            mm = LinearMMConfig(*(ScaledMMConfig(emulate, g.use_fast_accum, False, c.pad_inner_dim) for g in (
                c.gemm_config_output, c.gemm_config_grad_input, c.gemm_config_grad_weight)))
            self.linear = lambda x, w: matmul_with_hp_or_float8_args.apply(x, w.t(), mm, c)
        else:
            from torchao.prototype.moe_training import _to_mxfp8_then_scaled_grouped_mm
            from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
            from torchao.prototype.mx_formats.config import ScaleCalculationMode
            from torchao.quantization.quantize_.common import KernelPreference
            kernels = KernelPreference.EMULATED if emulate else KernelPreference.AUTO
            self.linear = lambda x, w: _to_mxfp8_then_scaled_mm(x, w, kernels, ScaleCalculationMode.RCEIL)
            # Each expert's token group padded to a multiple of 32: the weight gradient's scaling blocks run along
            # tokens and must not span two experts. bf16 out, as on a GPU (the emulation's operands are bf16 too).
            self.grouped = functools.partial(_to_mxfp8_then_scaled_grouped_mm, kernel_preference=kernels,
                                             out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=True)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.experts and func is F.linear and (args[2:] or [kwargs.get("bias")])[0] is None:
            x, w = args[:2]
            tokens = x.numel() // x.shape[-1]
            if torch.is_grad_enabled() and tokens % self.align:  # the weight gradient reduces over the tokens
                raise ValueError(f"--precision={self.precision} needs micro_batch x seq_len to be a multiple of "
                                 f"{self.align}, not {tokens}.")
            if torch.is_autocast_enabled(x.device.type):  # what autocast would have done to F.linear's operands
                dtype = torch.get_autocast_dtype(x.device.type)
                x, w = x.to(dtype), w.to(dtype)
            return self.linear(x, w)
        if self.experts and func is torch._grouped_mm and args[0].dim() == 2 and args[1].dim() == 3:
            return self.grouped(args[0], args[1], offs=kwargs["offs"])
        return func(*args, **kwargs)


def low_precision_modules(model: Transformer, precision: str) -> list[tuple[str, nn.Module]]:
    """The modules --precision converts: the blocks' attention and FFN linears and, in MXFP8, the routed experts.
    The router stays fp32 (its scores choose the experts), the embedding and head (the loss) in the compute dtype."""
    return [(name, m) for name, m in model.named_modules() if name.startswith("layers.") and (
        (isinstance(m, nn.Linear) and not name.endswith(".router"))
        or (isinstance(m, GroupedExperts) and precision == "mxfp8"))]


def check_precision(precision: str, cfg: ModelConfig, device: torch.device):
    """Raise ValueError if --precision cannot run here: no torchao, a GPU without the format, or a converted
    matmul's dimension off its scaling block."""
    if precision == "bf16":
        return
    if importlib.util.find_spec("torchao") is None:
        raise ValueError(f"--precision={precision} needs torchao: pip install torchao==0.18.0.")
    need = {"fp8": ((8, 9), "8.9 (Ada, Hopper: H100, H200)"), "mxfp8": ((10, 0), "10.0 (Blackwell: B200, B300)")}
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < need[precision][0]:
        has = torch.cuda.get_device_capability(device)
        raise ValueError(f"--precision={precision} needs compute capability {need[precision][1]} or more, not "
                         f"{has[0]}.{has[1]}; use --precision=bf16" + (" or fp8." if has >= need["fp8"][0] else "."))
    align = ALIGN[precision]
    dims = {"dim": cfg.dim, "n_heads x head_dim": cfg.n_heads * cfg.head_dim, "n_kv_heads x head_dim":
            cfg.n_kv_heads * cfg.head_dim, "dense_hidden": cfg.dense_hidden if cfg.n_dense_layers else align,
            "expert_hidden x n_shared_experts": cfg.expert_hidden * cfg.n_shared_experts or align,
            "expert_hidden": cfg.expert_hidden if precision == "mxfp8" else align}
    bad = [f"{name} = {value}" for name, value in dims.items() if value % align]
    if bad:
        raise ValueError(f"--precision={precision} scales blocks of {align} values, but {', '.join(bad)} is not a "
                         f"multiple of {align}; change it or use --precision=bf16.")


def set_precision(model: Transformer, precision: str, device: torch.device):
    """Run the converted modules' matmuls in `precision` from the next forward on ("bf16": as built). Only their
    forward changes (weights, FSDP and optimizer state stay), so a rollback can return a run to bf16 in place."""
    if getattr(model, "precision", None) == precision:  # unchanged: a compiled block keeps its graphs
        return
    for _, module in low_precision_modules(model, "mxfp8"):
        module.__dict__.pop("forward", None)
    if precision != "bf16":
        modes = {experts: LowPrecision(precision, device, experts) for experts in (False, True)}
        for _, module in low_precision_modules(model, precision):
            mode = modes[isinstance(module, GroupedExperts)]
            module.forward = functools.partial(_in_mode, mode, type(module).forward.__get__(module))
    model.precision = precision


def _in_mode(mode: LowPrecision, forward, *args, **kwargs):
    with mode:
        return forward(*args, **kwargs)


def _draw_whole_keep_shard(tensor: torch.Tensor, init):
    """DTensor's RNG tracker (CUDA only) draws each shard as a slice of one global stream; on CPU each sharded tensor
    is drawn whole and this rank keeps its shard: the weights of one process."""
    if not isinstance(tensor, DTensor):
        return init(tensor)
    whole = init(torch.empty(tensor.shape, dtype=tensor.dtype))
    tensor.copy_(distribute_tensor(whole, tensor.device_mesh, tensor.placements, src_data_rank=None))


def build_model(model_cfg: ModelConfig, layout: Layout, mesh: DeviceMesh | None, device: torch.device, ac="none",
                compile=False, param_dtype=None, seed=0, state_copies=1, precision="bf16") -> Transformer:
    """Build on meta, then EP, low precision, AC, compile and FSDP (torchtitan's order; mesh None: one process);
    allocate this rank's shards (on CPU, if `state_copies` fit) and draw the weights one process draws from `seed`."""
    check_precision(precision, model_cfg, device)
    model = meta_model(model_cfg)
    if mesh is not None and layout.ep > 1:
        apply_ep(model, mesh)
    set_precision(model, precision, device)
    if mesh is not None and layout.cp > 1:
        apply_cp(model, mesh)
    apply_ac(model, ac)
    if compile:
        apply_compile(model)
    if mesh is not None:
        apply_fsdp(model, mesh, param_dtype)
    if device.type == "cpu":
        check_host_memory(model, state_copies)
    model.to_empty(device=device)
    torch.manual_seed(seed)
    draw = _draw_whole_keep_shard if mesh is not None and device.type == "cpu" else None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
        model.init_weights(draw)
    return model


# --- The optimizer step: the global gradient norm; AdamW, or Muon for the hidden matrices

@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip all gradients to a total 2-norm of max_norm; return the norm before clipping. Each mesh's (dense,
    experts) norm is reduced over its own shards, then they are combined."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    by_spec: dict = {}
    for g in grads:
        by_spec.setdefault((g.device_mesh, g.placements) if isinstance(g, DTensor) else None, []).append(g)
    norms = [torch.nn.utils.get_total_norm(group, 2.0) for group in by_spec.values()]
    total_norm = torch.stack([(n.full_tensor() if isinstance(n, DTensor) else n).float() for n in norms]).norm()
    clip = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    if clip < 1:  # a host sync; steps within the norm skip a pass over the gradients
        locals_ = [local(g) for g in grads]  # views: scaling them scales the gradients
        torch._foreach_mul_(locals_, clip.to(locals_[0].device))
    return total_norm


NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic (torch.optim.Muon's too)
NS_STEPS = 5


def newton_schulz(u_XOF: torch.Tensor) -> torch.Tensor:
    """Orthogonalise each matrix of [X, O, F] (about U Vᵀ of its SVD): Frobenius norm 1, then NS_STEPS quintic
    iterations in the input's dtype, turned wide so the Gram matrices are the small ones."""
    a, b, c = NS_COEFFICIENTS
    tall = u_XOF.shape[-2] > u_XOF.shape[-1]
    w_XQW = u_XOF.mT if tall else u_XOF
    w_XQW = w_XQW / w_XQW.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-7)
    for _ in range(NS_STEPS):
        gram_XQQ = w_XQW @ w_XQW.mT
        poly_XQQ = torch.baddbmm(gram_XQQ, gram_XQQ, gram_XQQ, beta=b, alpha=c)
        w_XQW = torch.baddbmm(w_XQW, poly_XQQ, w_XQW, beta=a)
    return w_XQW.mT if tall else w_XQW


def deal(sizes: list[int], ranks: int) -> list[list[int]]:
    """Which of `sizes` each rank takes: largest first, to the least loaded (lowest on ties)."""
    load = [0] * ranks
    owned = [[] for _ in range(ranks)]
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        owner = min(range(ranks), key=load.__getitem__)
        load[owner] += sizes[i]
        owned[owner].append(i)
    return owned


def muon_layout(p: torch.Tensor) -> tuple[DeviceMesh, int] | None:
    """How Muon reaches whole matrices of `p` ([..., O, F]): None when this rank holds them (a plain tensor, or a
    DTensor sharded only on stacking dims: the routed experts), else the (mesh, mesh dim) whose ranks each hold a
    block of rows (FSDP's Shard(0) of a 2-D weight). ValueError for anything else."""
    if p.dim() < 2:
        raise ValueError(f"a parameter of shape {tuple(p.shape)} is in a Muon group; put it in one with muon=False.")
    if not isinstance(p, DTensor):
        return None
    if any(pl.is_partial() for pl in p.placements):
        raise ValueError(f"Muon needs reduced gradients, not placements {p.placements} ({tuple(p.shape)}).")
    # _StridedShard (FSDP over an already EP-sharded dim) is not a Shard subclass on every torch; both have .dim.
    # A mesh dim of one rank splits nothing.
    sharded = [(mesh_dim, pl.dim) for mesh_dim, pl in enumerate(p.placements)
               if getattr(pl, "dim", None) is not None and p.device_mesh.size(mesh_dim) > 1]
    in_matrix = [(mesh_dim, dim) for mesh_dim, dim in sharded if dim >= p.dim() - 2]
    if not in_matrix:
        return None
    if p.dim() == 2 and len(sharded) == 1 and in_matrix[0][1] == 0 and type(p.placements[in_matrix[0][0]]) is Shard:
        return p.device_mesh, in_matrix[0][0]
    raise ValueError(f"Muon needs whole matrices or Shard(0) rows over one mesh dim, not {p.placements} "
                     f"({tuple(p.shape)}).")


class Muon(torch.optim.Optimizer):
    """Muon for param groups marked muon=True, AdamW for the others: one step(), one state dict, each state tensor
    with its parameter's placements. torch.optim.Muon with adjust_lr_fn="original", batched; on a matrix [O, F], at
    lr·lr_scale (lr_scale: Muon's peak on lr's schedule):
        buf <- momentum·buf + (1 - momentum)·g;   u = (1 - momentum)·g + momentum·buf (Nesterov) or buf
        p   <- p·(1 - lr·wd) - lr·√max(1, O/F)·newton_schulz(u)
    Row-sharded matrices (FSDP's dense weights) are dealt to their group's ranks; whole ones (experts) stay."""

    def __init__(self, params, lr: float = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
                 nesterov: bool = True, betas: tuple = (0.9, 0.95), eps: float = 1e-8, fused: bool = False):
        defaults = dict(lr=lr, lr_scale=1.0, weight_decay=weight_decay, muon=True, momentum=momentum,
                        nesterov=nesterov, betas=tuple(betas), eps=eps, fused=fused)
        super().__init__(params, defaults)
        self.batch_elements = 2**27  # most elements in one stacked Newton-Schulz batch (its temporaries are ~4x)
        for p in (p for group in self.param_groups if group["muon"] for p in group["params"]):
            muon_layout(p)  # raises now, on every rank, rather than inside the first step's collectives

    def _dtype(self, device: torch.device) -> torch.dtype:  # Newton-Schulz's
        return torch.bfloat16 if device.type == "cuda" else torch.float32

    @staticmethod
    def _apply(p: torch.Tensor, o_XOF: torch.Tensor, group: dict):
        lr = group["lr"] * group["lr_scale"]
        rows, cols = p.shape[-2:]
        mine = local(p)
        mine.mul_(1 - lr * group["weight_decay"])  # then a bf16 update is added in fp32, with no cast of its own
        mine.add_(o_XOF.reshape(mine.shape), alpha=-lr * math.sqrt(max(1.0, rows / cols)))

    @torch.no_grad()
    def step(self, closure=None):  # the Optimizer interface: DCP's state-dict code calls step(closure=None)
        assert closure is None, "Muon.step evaluates no closure: compute the loss and backward first"
        by_layout = {}  # muon_layout -> [(param, update, group)]; None for whole matrices
        for group in self.param_groups:
            if not group["muon"]:
                self._adamw(group)
                continue
            for p in (p for p in group["params"] if p.grad is not None):
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p)
                g = local(p.grad)
                buf = local(self.state[p]["momentum_buffer"])
                buf.lerp_(g, 1 - group["momentum"])
                u = g.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                by_layout.setdefault(muon_layout(p), []).append((p, u, group))
        self._orthogonalise_local(by_layout.pop(None, []))
        for (mesh, mesh_dim), items in by_layout.items():
            self._orthogonalise_sharded(items, mesh, mesh_dim)

    def _orthogonalise_local(self, items: list):
        """Whole matrices, no communication: one Newton-Schulz per batch of same-shaped ones."""
        by_shape: dict = {}  # (matrix shape, device) -> its batches, the last one being filled
        for p, u, group in items:
            u = u.reshape(-1, *u.shape[-2:])
            batches = by_shape.setdefault((u.shape[-2:], u.device), [[]])
            if batches[-1] and sum(v.numel() for _, v, _ in batches[-1]) + u.numel() > self.batch_elements:
                batches.append([])
            batches[-1].append((p, u, group))
        for batch in sum(by_shape.values(), []):
            dtype = self._dtype(batch[0][1].device)  # cast before the copy into one batch: fewer bytes to move
            o_XOF = newton_schulz(torch.cat([u.to(dtype) for _, u, _ in batch]))
            for (p, u, group), o in zip(batch, o_XOF.split([u.shape[0] for _, u, _ in batch])):
                self._apply(p, o, group)

    def _orthogonalise_sharded(self, items: list, mesh: DeviceMesh, mesh_dim: int):
        """Row-sharded matrices: each rank orthogonalises its share, a matrix a round (rows in, then out)."""
        group_pg = mesh.get_group(mesh_dim)
        S = mesh.size(mesh_dim)
        me = mesh.get_local_rank(mesh_dim)
        # Each shard's rows: split like torch.chunk, as DTensor's Shard(0) and FSDP2 split them.
        sizes = [-(-p.shape[0] // S) for p, _, _ in items]
        rows = [[max(0, min(s, p.shape[0] - r * s)) for r in range(S)] for (p, _, _), s in zip(items, sizes)]
        owned = deal([p.numel() for p, _, _ in items], S)
        device = items[0][1].device
        dtype = self._dtype(device)
        nothing = torch.empty(0, dtype=dtype, device=device)
        for rnd in range(max(len(o) for o in owned)):
            todo = [o[rnd] if rnd < len(o) else None for o in owned]  # the matrix each rank orthogonalises now
            send = [items[i][1].reshape(-1).to(dtype) if i is not None else nothing for i in todo]
            send_splits = [t.numel() for t in send]
            mine = todo[me]
            recv_splits = [n * items[mine][0].shape[1] for n in rows[mine]] if mine is not None else [0] * S
            full = nothing.new_empty(sum(recv_splits))
            dist.all_to_all_single(full, torch.cat(send), recv_splits, send_splits, group=group_pg)
            if mine is not None:
                full = newton_schulz(full.view(1, *items[mine][0].shape)).reshape(-1)
            back = nothing.new_empty(sum(send_splits))
            dist.all_to_all_single(back, full, send_splits, recv_splits, group=group_pg)
            del full
            for o, i in zip(back.split(send_splits), todo):
                if i is not None:
                    self._apply(items[i][0], o, items[i][2])

    def _adamw(self, group: dict):
        """torch's AdamW (its functional form, fused where asked) on this rank's shards."""
        params = [p for p in group["params"] if p.grad is not None]
        for p in params:
            state = self.state[p]
            if not state:  # as torch.optim.AdamW: a CPU step count, or one on the parameter's device when fused
                state["step"] = torch.zeros((), device=local(p).device if group["fused"] else "cpu")
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
        states = [self.state[p] for p in params]
        adamw([local(p) for p in params], [local(p.grad) for p in params], [local(s["exp_avg"]) for s in states],
              [local(s["exp_avg_sq"]) for s in states], [], [s["step"] for s in states], fused=group["fused"] or None,
              amsgrad=False, beta1=group["betas"][0], beta2=group["betas"][1], lr=group["lr"] * group["lr_scale"],
              weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)


MUON_MOMENTUM = 0.95  # Nesterov, as in Keller Jordan's Muon and torch.optim.Muon; Trinity kept it


def build_optimizer(model, tc, fused: bool = True):
    """--optimizer=adamw: AdamW, weight decay on matrices only. --optimizer=muon: Muon at --muon_lr for the blocks'
    hidden matrices, AdamW at --lr for the embedding, head, norms and router (orthogonalising its rows, the experts'
    score vectors, would couple them). `fused`: torch's one-pass AdamW kernel, on CPU too."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    vectors = {"params": [p for _, p in params if p.dim() < 2], "weight_decay": 0.0}
    if tc.optimizer == "adamw":
        matrices = {"params": [p for _, p in params if p.dim() >= 2], "weight_decay": tc.weight_decay}
        return torch.optim.AdamW([matrices, vectors], lr=tc.lr, betas=(tc.beta1, tc.beta2), fused=fused)
    if tc.lr <= 0:
        raise ValueError(f"--lr={tc.lr} must be positive with --optimizer=muon (--muon_lr is relative to it).")
    hidden = {n for n, p in params if n.startswith("layers.") and p.dim() >= 2 and ".router." not in n}
    groups = [{"params": [p for n, p in params if n in hidden], "muon": True, "lr_scale": tc.muon_lr / tc.lr,
               "weight_decay": tc.weight_decay},
              {"params": [p for n, p in params if p.dim() >= 2 and n not in hidden], "muon": False,
               "weight_decay": tc.weight_decay},
              {**vectors, "muon": False}]
    return Muon(groups, lr=tc.lr, momentum=MUON_MOMENTUM, betas=(tc.beta1, tc.beta2), fused=fused)


# Dense bf16 peaks in TFLOP/s, for MFU (other devices report n/a). B300's gains are in FP4, not bf16.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "B200": 2250.0, "B300": 2250.0, "A100": 312.0}


def peak_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    return next((v for k, v in PEAK_TFLOPS.items() if k in torch.cuda.get_device_name(device)), None)
