//! Setup: the hello each peer gets, the agreement on the job configuration
//! it checks, and the limits both ends of a connection take.

use super::*;

impl Node {
    /// The largest message to `peer`: the smaller of the two transports'
    /// caps (the peer's is known once it is open: transmits that need it
    /// wait in `early` until then).
    pub(super) fn message_cap(&self, peer: u32) -> u64 {
        debug_assert!(
            self.peers[peer as usize].hello,
            "rank {peer}'s cap comes with its hello"
        );
        let cap = (self.limits.max_message_bytes as u64).min(self.peers[peer as usize].max_message);
        // Both ends take every control message (checked at new and at hello).
        debug_assert!(cap >= wire::MAX_CONTROL as u64);
        cap
    }

    /// The largest write to `peer`, a multiple of 4.
    pub(super) fn write_cap(&self, peer: u32) -> u64 {
        debug_assert!(
            self.peers[peer as usize].hello,
            "rank {peer}'s cap comes with its hello"
        );
        let cap = (self.limits.max_write_bytes as u64).min(self.peers[peer as usize].max_write) / 4 * 4;
        debug_assert!(cap >= 4, "both ends take writes of 4 bytes");
        cap
    }

    pub(super) fn connected(&mut self, peer: u32) -> Result<()> {
        let world = self.peers.len() as u32;
        if self.peer_mut(peer)?.lost {
            debug_assert_ne!(self.sched.trigger, Trigger::All, "only other triggers lose a worker");
            // A lost worker came back (a new process): a fresh peer.
            self.peers[peer as usize] = Peer {
                rejoined: true,
                ..Peer::default()
            };
            self.flow.reset_peer(peer);
            self.imm_sent[peer as usize] = 0;
            self.landed_from[peer as usize] = 0;
            self.early[peer as usize].clear();
            // Nothing of the old process is owed to the new one.
            self.landing_sparse.retain(|&(w, _), _| w != peer);
            if let Some(s) = self.server.as_mut() {
                s.credit_out.remove(&peer);
            }
        }
        let p = self.peer_mut(peer)?;
        if p.connected {
            return Err(EngineError::protocol(peer, ProtocolViolation::ConnectedTwice));
        }
        p.connected = true;
        let hello = Msg::Hello(Hello {
            version: u16::from(wire::VERSION),
            rank: self.rank,
            world,
            keys: self.keys,
            params_base: self.param_off.first().copied().unwrap_or(0),
            max_message: self.limits.max_message_bytes as u64,
            max_write: self.limits.max_write_bytes as u64,
            fields: self.job.fields().to_vec(),
        });
        self.send_ctrl(peer, &hello);
        Ok(())
    }

    pub(super) fn hello(&mut self, peer: u32, h: Hello) -> Result<()> {
        debug_assert!(!self.peers[peer as usize].hello, "a second hello is refused before");
        let bad = |violation| EngineError::protocol(peer, violation);
        if h.version != u16::from(wire::VERSION) {
            return Err(bad(ProtocolViolation::HelloVersion {
                theirs: h.version,
                ours: wire::VERSION,
            }));
        }
        if h.rank != peer {
            return Err(bad(ProtocolViolation::HelloRank { named: h.rank }));
        }
        if h.world as usize != self.peers.len() {
            return Err(EngineError::Disagree {
                rank: peer,
                field: "world size",
                theirs: h.world.to_string(),
                reference: "this rank".into(),
                ours: self.peers.len().to_string(),
            });
        }
        self.job.check(peer, &h.fields)?;
        let role = self.book.cluster().role(peer).expect("in the world");
        for (i, needed) in [role.is_worker(), role.is_server(), role.is_server()]
            .into_iter()
            .enumerate()
        {
            if needed && h.keys[i] == 0 && self.needs_region(peer, i) {
                return Err(bad(ProtocolViolation::HelloWithoutRegion {
                    region: ["parameter", "shard", "landing"][i],
                }));
            }
        }
        if h.max_message < wire::MAX_CONTROL as u64 || h.max_write < 4 {
            return Err(bad(ProtocolViolation::HelloLimits {
                max_message: h.max_message,
                max_write: h.max_write,
            }));
        }
        let p = self.peer_mut(peer)?;
        p.hello = true;
        p.keys = h.keys;
        p.params_base = h.params_base;
        p.max_message = h.max_message;
        p.max_write = h.max_write;
        self.out.push_back(Output::PeerKeys { peer, keys: h.keys });
        Ok(())
    }

    /// `peer`'s regions are known (after its hello): it opens (or opens
    /// again after a rejoin, which its server core hears of), and what
    /// waited for it in `early` goes out.
    pub(super) fn regions_known(&mut self, peer: u32) -> Result<()> {
        let p = self.peer_mut(peer)?;
        if !p.hello {
            return Err(EngineError::protocol(peer, ProtocolViolation::RegionsBeforeHello));
        }
        let rejoined = std::mem::take(&mut p.rejoined);
        let first = !p.open && !rejoined;
        p.open = true;
        if first {
            self.open_peers += 1;
            debug_assert!(self.open_peers < self.peers.len(), "every peer opens once");
        }
        self.flow.open(peer);
        if rejoined {
            if let Some(s) = self.server.as_mut() {
                let wi = self.book.cluster().worker_index(peer).expect("a worker");
                s.core.handle_worker_rejoined(wi)?;
            }
        }
        for e in std::mem::take(&mut self.early[peer as usize]) {
            match e {
                Early::Write {
                    src,
                    dst,
                    len,
                    imm,
                    track,
                } => self.write(peer, src, dst, len, imm, track),
                Early::Factors { layer, iter } => self.send_factors(peer, layer, iter),
            }
        }
        // Open now: nothing more waits for it.
        debug_assert!(self.early[peer as usize].is_empty());
        Ok(())
    }

    /// Whether this rank writes into `peer`'s region `i` (0 params, 1 shard, 2 landing).
    pub(super) fn needs_region(&self, peer: u32, i: usize) -> bool {
        debug_assert!(i < 3, "params, shard or landing");
        match i {
            0 => self.server.is_some(),
            1 => self.worker.as_ref().is_some_and(|w| w.core.index() == 0) && self.book.shard_len(peer) > 0,
            _ => self.worker.is_some() && self.book.shard_len(peer) > 0,
        }
    }
}
