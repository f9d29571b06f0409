"""The Tidewire side of a DistributedOptimizer: its setup (layers, session, hooks)."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import warnings
import zlib
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import torch
from torch import nn

from .. import _native
from .._config import CommConfig, Rates, SessionConfig
from .._native import TidewireError
from ._env import _bracketed, _job_id, _place, _probe_host
from ._utility import _Guard
from ._runtime import _new_index, _require
from ._collectives import _allgather_floats, _allgather_small
from ._layers import _DTYPES, _is_linear_sfb_candidate, _Layer, _Param
from ._checkpoint import _TwCheckpoint
from ._hooks import _TwHooks
from ._sync import _TwSync


class _Tw(_TwCheckpoint, _TwHooks, _TwSync):
    """The Tidewire side of a DistributedOptimizer (kept apart from the torch
    optimizer's own attributes)."""

    def __init__(
        self,
        opt: torch.optim.Optimizer,
        named_parameters: Optional[Iterable[Tuple[str, nn.Parameter]]],
        backward_passes_per_step: int,
        model: Optional[nn.Module],
        apply: str,
        sfb: Union[bool, str],
        consistency: Union[str, Tuple[str, int]],
        prefetch: bool,
        batch_size: Optional[int],
        broadcast_buffers: Optional[bool],
        timeout: Optional[float],
        comm: Optional[Dict[str, Any]] = None,
        ckpt: Optional[Dict[str, Any]] = None,
        reduce: Optional[Dict[str, Any]] = None,
    ) -> None:
        env, _ = _require()
        self.env = env
        self.opt = opt
        self.model = model
        self.closed = False
        if apply not in ("local", "server"):
            raise ValueError(f"apply={apply!r}: want 'local' (the torch optimizer steps) or 'server'")
        self.apply = apply
        if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
            raise ValueError(f"backward_passes_per_step={backward_passes_per_step!r}: want an int >= 1")
        self.bpps = backward_passes_per_step
        explicit = sfb is True
        if sfb is True:
            sfb = "auto"
        if sfb is not False and sfb not in ("auto", "always", "adaptive"):
            raise ValueError(f"sfb={sfb!r}: want False, True/'auto' (HybComm), 'adaptive' or 'always'")
        self.adapt_every = 0
        if sfb == "adaptive":
            self.adapt_every = int(os.environ.get("TIDEWIRE_ADAPT_EVERY", "10"))
            if self.adapt_every < 2:
                raise ValueError(f"TIDEWIRE_ADAPT_EVERY={self.adapt_every}: want a period of at least 2 steps")
            if consistency != "bsp":
                raise ValueError("sfb='adaptive' needs consistency='bsp'")
        can_sfb = model is not None and batch_size is not None
        if (explicit or sfb == "always") and not can_sfb:
            raise ValueError(f"sfb={'True' if explicit else repr(sfb)} needs model= and batch_size=")
        self.sfb: Union[bool, str] = sfb if (sfb is not False and can_sfb) else False
        if env.local_agg and self.sfb:
            if explicit or sfb == "always":
                raise ValueError(
                    "sfb: with local aggregation a node's learners sum their gradients before the one push, "
                    "so every layer syncs through the PS: drop sfb="
                )
            self.sfb = False
        if consistency == "bsp":
            self.consistency: Union[str, Tuple[str, int]] = "bsp"
        elif isinstance(consistency, (tuple, list)) and len(consistency) == 2 and consistency[0] == "ssp":
            s = int(consistency[1])
            if s < 0:
                raise ValueError("SSP staleness must be >= 0")
            self.consistency = ("ssp", s)
        else:
            raise ValueError(f"consistency={consistency!r}: want 'bsp' or ('ssp', s)")
        if self.consistency != "bsp" and apply == "local":
            raise ValueError(
                "consistency=('ssp', s) needs apply='server': in 'local' mode a stale pull would hand the "
                "torch optimizer an old averaged gradient a second time"
            )
        if prefetch and model is None:
            raise ValueError("prefetch=True needs model= (its forward pre-hooks pull each layer)")
        self.prefetch = bool(prefetch)
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size={batch_size!r}: want a positive int")
        self.batch_size = batch_size
        self.broadcast_buffers = (model is not None) if broadcast_buffers is None else bool(broadcast_buffers)
        if self.broadcast_buffers and model is None:
            raise ValueError("broadcast_buffers=True needs model=")
        self.timeout = env.timeout if timeout is None else float(timeout)
        self.grad_rebinds = 0
        self.rates: Optional[Rates] = None  # what HybComm decided with (sfb="auto")
        self.synced = False  # this step's layers are all pushed
        self.pending = False  # a gradient arrived since the last step
        self.skip_sync = False
        self.handles: List[Any] = []
        self.sgd: Optional[Tuple[float, float, float]] = None
        if apply == "server":
            self.sgd = self._server_sgd(opt)
        self._setup_reduce(reduce or {}, explicit or sfb == "always")
        self._setup_comm(comm or {})
        if self.comm_on and self.reduce_custom:
            raise ValueError(
                "comm_every/comm_mode/quality_guided need op=Average, gradient_predivide_factor=1 and no compression"
            )
        self._setup_checkpoint(ckpt or {})
        self._build_layers(opt, named_parameters)
        self._build_session()
        self._install_hooks()

    # ----------------------------------------------------------------- setup

    def _setup_reduce(self, r: Dict[str, Any], sfb_asked: bool) -> None:
        """Horovod's op, gradient_predivide_factor and compression (see DistributedOptimizer)."""
        from ._compression import NoneCompressor, _check_compression
        from ._reduce import ReduceOp, _check_adasum, _resolve_op

        # op=Adasum with more than one rank never gets here (DistributedOptimizer builds _adasum's optimizer).
        op = _check_adasum(_resolve_op(r.get("op"), None), self.env.size, torch.float32, "DistributedOptimizer")
        if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
            raise ValueError(f"op={op.name.title()}: DistributedOptimizer reduces gradients with Average or Sum")
        f = float(r.get("gradient_predivide_factor", 1.0))
        if not (f > 0.0 and f < float("inf")):
            raise ValueError(f"gradient_predivide_factor={f}: want a finite number > 0")
        if f != 1.0 and op != ReduceOp.AVERAGE:
            raise ValueError("gradient_predivide_factor is only supported with op=Average (as in Horovod)")
        self.compression = _check_compression(r.get("compression", NoneCompressor))
        self.op = op
        #: Gradients are multiplied by ``prescale`` before the push and the servers'
        #: sum by ``postscale`` after the pull (gradient_predivide_factor f: 1/f and f/size).
        self.prescale = 1.0 / f if f != 1.0 else None
        self.postscale = f / self.env.size if f != 1.0 else None
        self.reduce_custom = op != ReduceOp.AVERAGE or f != 1.0 or self.compression is not NoneCompressor
        if not self.reduce_custom:
            return
        if self.apply == "server" and (op != ReduceOp.AVERAGE or f != 1.0):
            raise ValueError("apply='server' averages the gradients: op=Sum and gradient_predivide_factor need 'local'")
        if self.sfb:
            if sfb_asked:
                raise ValueError(
                    "sfb: op=Sum, gradient_predivide_factor and compression act on the gradient itself, so every "
                    "layer syncs through the parameter servers: drop sfb="
                )
            self.sfb = False

    def _apply_op(self) -> Any:
        """The servers' ApplyOp: mean, or sum (op=Sum, or a predivide factor: the workers scale)."""
        from ._reduce import ReduceOp

        if self.sgd is not None:
            return ("sgd",) + self.sgd
        return "mean" if self.op == ReduceOp.AVERAGE and self.prescale is None else "sum"

    def _setup_comm(self, c: Dict[str, Any]) -> None:
        """Communication frequency (comm_every, comm_mode, quality_guided): see DistributedOptimizer."""
        every = c.get("comm_every", 1)
        mode = c.get("comm_mode", "accumulate")
        guided = bool(c.get("quality_guided", False))
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"comm_every={every!r}: want an int >= 1")
        if mode not in ("accumulate", "average"):
            raise ValueError(f"comm_mode={mode!r}: want 'accumulate' or 'average'")
        t_max = c.get("comm_every_max", 16) if guided else every
        if not isinstance(t_max, int) or t_max < every:
            raise ValueError(f"comm_every_max={t_max!r}: want an int >= comm_every ({every})")
        period = c.get("quality_period", 4)
        if not isinstance(period, int) or period < 1:
            raise ValueError(f"quality_period={period!r}: want an int >= 1 (exchanges per window)")
        tol = float(c.get("quality_tolerance", 0.02))
        if not (tol >= 0.0 and tol < float("inf")):
            raise ValueError(f"quality_tolerance={tol!r}: want a finite number >= 0")
        revert = c.get("quality_revert_at")
        if revert is not None and (not isinstance(revert, int) or revert < 0):
            raise ValueError(f"quality_revert_at={revert!r}: want a step number >= 0 or None")
        #: Whether the communication frequency differs from "every step, gradients".
        self.comm_on = every > 1 or guided or mode == "average"
        self.comm_mode = mode
        self.guided = guided
        self.comm = CommConfig(mode, every, t_max, period, tol, revert)
        if self.comm_on:
            what = f"comm_every={every}, comm_mode={mode!r}" + (", quality_guided=True" if guided else "")
            if self.apply != "local":
                raise ValueError(f"{what} needs apply='local' (the servers average; the torch optimizer steps)")
            if self.bpps != 1:
                raise ValueError(f"{what} replaces backward_passes_per_step: leave it at 1")
            if self.consistency != "bsp":
                raise ValueError(f"{what} needs consistency='bsp'")
            if self.sfb not in (False, "auto", "adaptive"):
                raise ValueError(f"{what} syncs through the parameter servers: pass sfb=False")
            if self.env.local_agg:
                raise ValueError(f"{what} with local aggregation (TIDEWIRE_LOCAL_AGGREGATION) is not supported yet")
            self.sfb = False
        self.guide = _native.FreqGuide(self.comm, self.env.rank, self.env.size)
        self.accumulating = False  # accumulate mode: gradients of steps since the last exchange are held
        self.since = 0  # steps since the last exchange
        self.steps_done = 0  # step() calls (and flushes)
        self.extra_exchanges = 0
        self.quality: Optional[_Layer] = None

    @staticmethod
    def _server_sgd(opt: torch.optim.Optimizer, check_type: bool = True) -> Tuple[float, float, float]:
        if check_type and type(opt) is not torch.optim.SGD:
            raise ValueError(
                f"apply='server' supports torch.optim.SGD only (got {type(opt).__name__}): "
                "use apply='local' for other optimizers"
            )
        if len(opt.param_groups) != 1:
            raise ValueError(
                f"apply='server' needs one param group (got {len(opt.param_groups)}): Tidewire's servers apply "
                "one lr, momentum and weight decay"
            )
        g = opt.param_groups[0]
        if g.get("nesterov"):
            raise ValueError("apply='server' does not do Nesterov momentum: use nesterov=False or apply='local'")
        if g.get("dampening", 0) != 0:
            raise ValueError("apply='server' needs dampening=0 (Caffe-form momentum): or use apply='local'")
        if g.get("maximize"):
            raise ValueError("apply='server' does not maximize: use apply='local'")
        return float(g["lr"]), float(g.get("momentum", 0.0)), float(g.get("weight_decay", 0.0))

    def _build_layers(
        self, opt: torch.optim.Optimizer, named_parameters: Optional[Iterable[Tuple[str, nn.Parameter]]]
    ) -> None:
        opt_params = [p for g in opt.param_groups for p in g["params"]]
        opt_ids = {id(p) for p in opt_params}
        synthetic = False
        if named_parameters is not None:
            named = list(named_parameters)
        elif self.model is not None:
            named = list(self.model.named_parameters())
        else:
            named = [(f"group{gi}.param{pi}", p) for gi, g in enumerate(opt.param_groups) for pi, p in enumerate(g["params"])]
            synthetic = True
        seen: Dict[int, str] = {}
        names: Dict[str, int] = {}
        kept: List[Tuple[str, nn.Parameter]] = []
        for item in named:
            if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
                raise TypeError("named_parameters: want (name, parameter) pairs, e.g. model.named_parameters()")
            nm, p = str(item[0]), item[1]
            if id(p) in seen:
                continue  # a tied parameter counts once
            if nm in names:
                raise ValueError(f"named_parameters: the name {nm!r} names two different parameters")
            seen[id(p)] = nm
            names[nm] = id(p)
            if not p.requires_grad or id(p) not in opt_ids:
                continue
            kept.append((nm, p))
        missing = [p for p in opt_params if p.requires_grad and id(p) not in seen]
        if missing:
            shapes = ", ".join(str(tuple(p.shape)) for p in missing[:5])
            raise ValueError(
                f"named_parameters misses {len(missing)} parameter(s) the optimizer updates (shapes {shapes}): "
                "pass named_parameters=model.named_parameters() of the model the optimizer trains"
            )
        if not kept:
            raise ValueError("no parameter to sync: the optimizer has no parameter with requires_grad=True")
        for nm, p in kept:
            if p.dtype not in _DTYPES:
                raise TypeError(
                    f"parameter {nm!r} is {p.dtype}: tidewire.torch syncs float32, float16, bfloat16 and "
                    "float64 parameters"
                )
            if p.is_sparse:
                raise TypeError(f"parameter {nm!r} is sparse: tidewire.torch syncs dense parameters")
        dtypes = {p.dtype for _, p in kept}
        if len(dtypes) != 1:
            raise TypeError(
                f"parameters of several dtypes ({sorted(map(str, dtypes))}): one DistributedOptimizer syncs one "
                "dtype (make one optimizer per dtype, or cast the model)"
            )
        #: The parameters' dtype: float32 is registered in place; float16, bfloat16 and
        #: float64 are widened to float32 at each push and narrowed back at each pull
        #: (the wire and the servers' sums are float32; float64 keeps float32's precision).
        self.dtype = next(iter(dtypes))
        devices = {p.device for _, p in kept}
        if len(devices) != 1:
            raise ValueError(f"parameters on several devices ({sorted(map(str, devices))}): one device per process")
        self.device = next(iter(devices))
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"parameters on {self.device}: tidewire.torch supports cpu and cuda")
        self.staged = self.device.type == "cuda" or os.environ.get("TIDEWIRE_TORCH_STAGING") == "1"
        # Group by module: the name's prefix (with synthetic names, one layer per parameter).
        groups: Dict[str, List[Tuple[str, nn.Parameter]]] = {}
        for nm, p in kept:
            key = nm if synthetic else (nm.rsplit(".", 1)[0] if "." in nm else "")
            groups.setdefault(key, []).append((nm, p))
        # Which modules hold each parameter (for tied weights and prefetch).
        self.holders: Dict[int, List[nn.Module]] = {}
        if self.model is not None:
            for mod in self.model.modules():
                for p in mod._parameters.values():
                    if p is not None:
                        self.holders.setdefault(id(p), []).append(mod)
        self.layers: List[_Layer] = []
        self.by_param: Dict[int, _Param] = {}
        k_rows = self._k_rows()
        for key, ps in groups.items():
            module = None
            if self.model is not None and not synthetic:
                try:
                    module = self.model.get_submodule(key)
                except AttributeError:
                    module = None
            L = _Layer(len(self.layers), key or "<root>", module)
            total = sum(p.numel() for _, p in ps)
            shared = any(len(self.holders.get(id(p), [])) > 1 for _, p in ps)
            if self.sfb and not shared and _is_linear_sfb_candidate(module, ps):
                lin = module
                assert isinstance(lin, nn.Linear)
                L.kind, L.sfb_layout = "fc", True
                L.m, L.n = lin.out_features, lin.in_features + (1 if lin.bias is not None else 0)
                # The bias goes last whatever the order named_parameters gave.
                ps = sorted(ps, key=lambda kv: 0 if kv[1] is lin.weight else 1)
            elif not self.sfb and type(module) is nn.Linear and _is_linear_sfb_candidate(module, ps):
                L.kind, L.m, L.n = "fc", module.out_features, total // module.out_features
            elif isinstance(module, nn.modules.conv._ConvNd) and total % module.out_channels == 0:
                L.kind, L.m, L.n = "conv", module.out_channels, total // module.out_channels
            else:
                L.kind, L.m, L.n = "other", 1, total
            # An embedding with sparse gradients: its layer gets the sparse-push hint. Its
            # sparse .grad is added into the layer's dense view of the flat buffer.
            L.sparse = isinstance(module, nn.Embedding) and bool(module.sparse)
            assert L.m * L.n == total
            L.numel = total
            for nm, p in ps:
                info = _Param(p, nm, L)
                L.params.append(info)
                self.by_param[id(p)] = info
            self.layers.append(L)
        if self.guided:
            # The quality figures travel in one extra layer of one value per learner.
            Q = _Layer(len(self.layers), "tidewire.quality", None)
            Q.kind, Q.m, Q.n, Q.numel = "other", 1, self.env.size, self.env.size
            self.layers.append(Q)
            self.quality = Q
        off = 0
        for L in self.layers:
            L.offset = off
            off += L.numel
        self.total = off
        self.k_rows = k_rows

    def _k_rows(self) -> int:
        """K: the rows of U and V (the batch, times the backward passes per step)."""
        return (self.batch_size or 32) * self.bpps

    def _views(self, flat: torch.Tensor, L: _Layer) -> List[torch.Tensor]:
        blk = flat[L.offset : L.offset + L.numel]
        if L.sfb_layout:
            mat = blk.view(L.m, L.n)
            lin = L.module
            assert isinstance(lin, nn.Linear)
            out = [mat[:, : lin.in_features]]
            if lin.bias is not None:
                out.append(mat[:, lin.in_features])
            return out
        views, at = [], 0
        for info in L.params:
            n = info.param.numel()
            views.append(blk[at : at + n].view(info.param.shape))
            at += n
        return views

    def _table(self) -> List[Tuple[str, str, int, int]]:
        return [(L.name, L.kind + (":sparse" if L.sparse else ""), L.m, L.n) for L in self.layers]

    def _agreed_rates(self) -> Rates:
        """The rates HybComm decides with (``sfb='auto'``), the same on every
        rank: each rank measures its machine (``tidewire calibrate``'s rates,
        about 0.4 s), and one rank probes the link to rank 0 (a TCP stream of
        about 0.3 s: from the first rank of the next host, or rank 1 where
        every rank shares one host); the ranks share the figures and every
        rank takes rank 0's, its CPU and memory divided among the ranks on its host
        (``LOCAL_WORLD_SIZE``), and the probed link. Only rank 0 measures
        (the others wait), so that its figures are the machine's, not a
        share of it taken twice. Rebuilding a CUDA
        layer's gradient from its factors runs on the CPU today, so its GEMM
        is the CPU's. ``TIDEWIRE_RATES`` (JSON) overrides all of it."""
        env = self.env
        given = os.environ.get("TIDEWIRE_RATES")
        if given:
            try:
                d = json.loads(given)
                mine = [float(d[k]) for k in ("link_bytes_per_s", "msg_s", "sum_bytes_per_s", "gemm_flop_per_s")]
                host = int(d.get("host_ranks", 1))
                on_host = bool(d.get("link_on_host", False))
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                raise TidewireError(
                    f"TIDEWIRE_RATES={given!r}: {e} (want JSON with link_bytes_per_s, msg_s, sum_bytes_per_s, "
                    "gemm_flop_per_s)"
                ) from None
            every = _allgather_floats(mine + [float(host), float(on_host)], "DistributedOptimizer/rates")
            if any(r != every[0] for r in every):
                raise TidewireError("TIDEWIRE_RATES differs between ranks: give every rank the same")
            link, msg, summ, gemm, host_f, on_host_f = every[0]
            return Rates(link, msg, summ, gemm, int(host_f), on_host_f != 0.0)
        # Only rank 0 measures: every rank takes its figures, and ranks that
        # measured at once on shared cores would each see a fraction of the
        # machine (4 ranks on 2 cores read half the loopback stream and half
        # the GEMM, which then counted twice with the share below). The
        # others wait in the gather, idle.
        c, loop, msg, summ, gemm, mem = _native.calibrate(100) if env.rank == 0 else (0, 0.0, 0.0, 0.0, 0.0, 0.0)
        probed = 0.0
        probe = None
        if env.size > 1:
            peer = env.local_size if env.size > env.local_size else 1
            if env.rank == 0:
                try:
                    probe = _native.LinkProbe(_probe_host(env.host))
                except (TidewireError, ValueError) as e:
                    warnings.warn(f"tidewire: no link probe ({e}); HybComm weighs the loopback rate", stacklevel=3)
            port = _allgather_small([probe.port if probe is not None else 0], "DistributedOptimizer/probe")[0][0]
            if env.rank == peer and port:
                try:
                    target = _bracketed(env.host) if ":" in env.host else socket.gethostbyname(env.host)
                    probed = _native.probe_stream(f"{target}:{port}", 300)
                except (TidewireError, ValueError, OSError) as e:
                    warnings.warn(
                        f"tidewire: the link probe to rank 0 failed ({e}); HybComm weighs the loopback rate",
                        stacklevel=3,
                    )
        every = _allgather_floats([float(c), loop, msg, summ, gemm, mem, probed], "DistributedOptimizer/rates")
        probed = max(r[6] for r in every)
        if probe is not None and probed > 0:
            try:
                probe.join()  # done already: the prober read its count before the gather
            except TidewireError as e:
                warnings.warn(f"tidewire: the link probe's server: {e}", stacklevel=3)
        # Without a probe, rank 0's server thread gives up by itself within 30 s.
        cores0, loop0, msg0, summ0, gemm0, mem0, _ = every[0]
        # As tidewire::calibrate::Profile::node_rates: the CPU shared like the
        # cores, the sum also like the host's memory.
        ranks = max(1, env.local_size)
        share = min(1.0, cores0 / ranks)
        link = loop0 * share
        if probed > 0:
            link = min(link, probed)
        # One host: the probe ran over its loopback, whose bytes are its cores' work.
        on_host = env.size <= env.local_size
        return Rates(link, msg0 / share, min(summ0 * share, mem0 / ranks), gemm0 * share, ranks, on_host)

    def _build_session(self) -> None:
        env = self.env
        index = _new_index()
        policy = "ps" if not self.sfb else ("sfb" if self.sfb == "always" else "hybrid")
        if env.local_agg:
            policy = "ps"  # a node's learners sum gradients: no factors (see __init__)
        apply_op: Union[str, Tuple[str, float, float, float]] = self._apply_op()
        desc = repr(
            (index, self._table(), [L.sfb_layout for L in self.layers], self.apply, apply_op, policy,
             self.k_rows, self.consistency, self.bpps, self.comm)
        )
        digest = zlib.crc32(desc.encode())
        mine = [index & 0xFFFF, len(self.layers) & 0xFFFF, digest & 0xFFFF, digest >> 16]
        every = _allgather_small(mine, "DistributedOptimizer/table")
        differ = [r for r, v in enumerate(every) if v != every[0]]
        if differ:
            raise TidewireError(
                f"ranks {differ} would build a different DistributedOptimizer than rank 0 (layer table, apply, sfb, "
                f"batch_size, consistency or backward_passes_per_step differ, or the ranks built optimizers in a "
                f"different order). This rank (rank {env.rank}) has {len(self.layers)} layers: "
                + ", ".join(f"{n} {k} {m}x{nn_}" for n, k, m, nn_ in self._table()[:8])
                + (" ..." if len(self.layers) > 8 else "")
            )
        rates = self._agreed_rates() if policy == "hybrid" else None
        if rates is not None and self.sfb == "adaptive":
            # Every FC layer then goes as its factors, and the engine forms a
            # PS layer's gradient from them: a GEMM SFB does not run.
            rates = dataclasses.replace(rates, ps_builds_grad=True)
        self.rates = rates
        pin = self.device.type == "cuda"
        self.g_host = torch.zeros(self.total, dtype=self.dtype, pin_memory=pin)
        self.r_host = torch.zeros(self.total, dtype=self.dtype, pin_memory=pin)
        if self.staged:
            self.g_dev = torch.zeros(self.total, dtype=self.dtype, device=self.device)
            self.r_dev = torch.zeros(self.total, dtype=self.dtype, device=self.device)
        else:
            self.g_dev, self.r_dev = self.g_host, self.r_host
        # Both modes start from the parameters' values: the session broadcasts rank 0's.
        for L in self.layers:
            for info, v in zip(L.params, self._views(self.r_host, L)):
                v.copy_(info.param.detach())
        self.index = index
        config = SessionConfig(
            layers=self._table(),
            **_place(env, index),
            master=env.master(index),
            secret=env.secret,
            job=_job_id(env, index),
            batch=self.k_rows,
            apply=apply_op,
            consistency=self.consistency,
            policy=policy,
            adapt_every=self.adapt_every if self.sfb == "adaptive" and policy == "hybrid" else 0,
            transport=env.transport,
            timeout=self.timeout,
            connect_timeout=max(self.timeout, 60.0),
            comm=self.comm if self.comm_on else None,
            checkpoint=self.ckpt if self.ckpt_dir is not None else None,
            resume=self.resumed_from,
            rates=rates,
        )
        self.session = _Guard(_native.Session(config, params=self.r_host, grads=self.g_host))
        self.start_step = self.session.start_iteration
        if self.staged:
            self.r_dev.copy_(self.r_host)
        adaptive = self.sfb == "adaptive" and policy == "hybrid"
        for L in self.layers:
            L.scheme = self.session.scheme(L.index)
            # Decided in the run: an FC layer may go either way at any step, so it
            # always goes as its factors (the engine forms the gradient for the PS).
            L.factors = L.scheme == "sfb" or (adaptive and L.kind == "fc")
            gv, rv = self._views(self.g_dev, L), self._views(self.r_dev, L)
            for info, g, r in zip(L.params, gv, rv):
                info.gview, info.rview = g, r
                p = info.param
                with torch.no_grad():
                    if p.grad is not None:
                        g.copy_(p.grad.to_dense() if p.grad.is_sparse else p.grad)
                    if self.apply == "server":
                        p.data = r  # the parameter lives in the registered buffer
                    else:
                        p.copy_(r)  # rank 0's initial values
                p.grad = g
                info.cleared = False

    # ----------------------------------------------------------------- suspend / resume

    def reopen_refusal(self) -> Optional[str]:
        """Why :meth:`reopen` cannot rebuild this optimizer's session, or None."""
        if self.ckpt_dir is not None:
            return "it checkpoints (checkpoint_dir=), whose step numbering a new session would restart"
        if self.comm_on:
            return "comm_every/comm_mode/quality_guided keep per-session exchange state"
        if self.env.local_agg:
            return "local aggregation (TIDEWIRE_LOCAL_AGGREGATION) is not supported across suspend/resume"
        return None

    def reopen(self, env: Any) -> None:
        """After BytePS's resume: a new session (the next session index, on
        every rank in the same order) over the same layers, from rank 0's
        current parameters, and the hooks again. The optimizer was closed."""
        assert self.closed and self.reopen_refusal() is None
        self.env = env
        self.resumed_from = None
        self.synced = self.pending = self.skip_sync = False
        self.closed = False
        self._build_session()
        self._install_hooks()

    def _install_hooks(self) -> None:
        for info in self.by_param.values():
            info.hook = info.param.register_post_accumulate_grad_hook(self._make_grad_hook(info))
            self.handles.append(info.hook)
        for L in self.layers:
            if L.factors:
                assert isinstance(L.module, nn.Linear)
                self.handles.append(L.module.register_forward_hook(self._make_capture(L)))
        if self.prefetch and self.apply == "server" and self.model is not None:
            owners: Dict[int, Tuple[nn.Module, List[_Layer]]] = {}
            for info in self.by_param.values():
                for mod in self.holders.get(id(info.param), []):
                    entry = owners.setdefault(id(mod), (mod, []))
                    if info.layer not in entry[1]:
                        entry[1].append(info.layer)
            for mod, layers in owners.values():
                self.handles.append(mod.register_forward_pre_hook(self._make_prefetch(mod, layers)))
