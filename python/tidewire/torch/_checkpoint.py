"""DistributedOptimizer's checkpoints (checkpoint_dir, resume): the torch side of each."""

from __future__ import annotations

import io
import os
from typing import Any, Dict, Optional

import torch

from .. import _native
from .._config import Checkpointing


class _TwCheckpoint:
    """_Tw's checkpoint methods (a mixin of :class:`_Tw`)."""

    def _setup_checkpoint(self, c: Dict[str, Any]) -> None:
        """checkpoint_dir, checkpoint_every, checkpoint_keep, resume: see DistributedOptimizer."""
        d = c.get("checkpoint_dir")
        every = c.get("checkpoint_every", 100)
        keep = c.get("checkpoint_keep", 2)
        resume = c.get("resume", False)
        self.ckpt_dir: Optional[str] = None if d is None else os.fspath(d)
        self.ckpt_every = every
        self.start_step = 0
        self.resumed_from: Optional[str] = None
        self.wrapper: Optional[torch.optim.Optimizer] = None
        if self.ckpt_dir is None:
            if resume is True:
                raise ValueError("resume=True resumes from checkpoint_dir: give checkpoint_dir")
            if resume not in (False, None):
                # Resume from that checkpoint, without checkpointing this run.
                self.resumed_from = os.fspath(resume)
            return
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"checkpoint_every={every!r}: want an int >= 1")
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"checkpoint_keep={keep!r}: want an int >= 1")
        if self.comm_on:
            raise ValueError("checkpoint_dir with comm_every/comm_mode/quality_guided is not supported yet")
        if self.env.local_agg:
            raise ValueError("checkpoint_dir with local aggregation (TIDEWIRE_LOCAL_AGGREGATION) is not supported yet")
        self.ckpt = Checkpointing(self.ckpt_dir, every, keep, True)
        if resume is True:
            # A restarted job (torchrun's elastic restart runs the script again):
            # the newest complete checkpoint, if there is one.
            self.resumed_from = _native.newest_checkpoint(self.ckpt_dir)
        elif resume not in (False, None):
            self.resumed_from = os.fspath(resume)

    def _save_checkpoint(self, k: int) -> None:
        """Worker rank 0 saves the torch side of checkpoint ``k``: the model's
        state_dict (or the parameters) and the optimizer's."""
        if self.prefetch and self.apply == "server":
            self.pull_all()  # the servers' values must be in place before they are read
        named = self.model.state_dict() if self.model is not None else {
            info.name: info.param.detach() for info in self.by_param.values()
        }
        state = {
            "step": k,
            "model": {n: t.detach().cpu().clone() for n, t in named.items()},
            "optimizer": self.wrapper.state_dict() if self.wrapper is not None else self.opt.state_dict(),
        }
        buf = io.BytesIO()
        torch.save(state, buf)
        self.session.save_framework_state(k, buf.getvalue())

    def restore(self, wrapper: torch.optim.Optimizer) -> None:
        """After the build: a resumed job takes the torch side of its checkpoint."""
        self.wrapper = wrapper
        blob = self.session.framework_state() if self.ckpt_dir is not None or self.resumed_from else None
        if blob is None:
            return
        state = torch.load(io.BytesIO(blob), weights_only=False)
        with torch.no_grad():
            if self.model is not None:
                self.model.load_state_dict(state["model"])
            else:
                for info in self.by_param.values():
                    info.param.copy_(state["model"][info.name])
        wrapper.load_state_dict(state["optimizer"])
