//! Readiness after setup, and the goodbye: `Finished` when the worker is
//! idle, `Bye` when the server owes nothing more, and the exit once every
//! peer said goodbye.

use super::*;

impl Node {
    pub(super) fn check_ready(&mut self) {
        if self.life.ready() {
            return;
        }
        if self.open_peers + 1 < self.peers.len() {
            return;
        }
        let initialized = match (&mut self.worker, &self.server) {
            (Some(w), _) => {
                if !w.core.is_initialized() {
                    false
                } else if !self.staged {
                    true
                } else if !w.publish_started {
                    w.publish_started = true;
                    w.publish_left = self.book.layers().len();
                    for l in 0..self.book.layers().len() as u32 {
                        self.publish(l, None);
                    }
                    false
                } else {
                    self.worker.as_ref().expect("worker").publish_left == 0
                }
            }
            (None, Some(s)) => s.core.is_initialized(),
            (None, None) => true,
        };
        if initialized {
            debug_assert_eq!(self.open_peers + 1, self.peers.len(), "every peer is open");
            // A worker has every chunk only once every shard, this rank's too, was seeded.
            debug_assert!(self.server.as_ref().map_or(true, |s| s.core.is_initialized()));
            let next = if self.life.shutdown() {
                Life::Draining
            } else {
                Life::Running
            };
            self.life.advance(next);
            self.out.push_back(Output::Ready);
        }
    }

    pub(super) fn pending_jobs(&self, queue: Queue) -> usize {
        self.jobs.values().filter(|t| t.queue() == queue).count()
    }

    /// Whether the peer's `Finished`/`Bye` (`count`) is settled: the writes it
    /// counted have landed, or its connection closed gracefully after it (TCP
    /// and RDMA place every write before the close).
    pub(super) fn peer_done(&self, p: u32, count: Option<u64>) -> bool {
        count.is_some_and(|n| self.landed_from[p as usize] >= n || self.peers[p as usize].closed)
    }

    /// On a server, once a worker has finished (and its writes landed): a
    /// slice that another worker pushed further than it can never complete.
    /// Without this check every rank's shutdown would wait for it forever.
    /// It runs only after a worker finished, and only when a write landed or
    /// a peer's state changed since the last run.
    pub(super) fn check_stranded(&mut self) -> Option<EngineError> {
        if !self.stranded_dirty || !self.any_finished {
            return None;
        }
        self.stranded_dirty = false;
        let s = self.server.as_ref()?;
        let book = &self.book;
        let workers = book.cluster().workers();
        let finished = |wi: usize| {
            let w = workers[wi];
            if w == self.rank {
                self.life >= Life::FinishedSent
            } else {
                self.peer_done(w, self.peers[w as usize].finished)
            }
        };
        let (wi, slice, iter) = s.core.stranded(finished)?;
        let layer = book.slices()[slice as usize].layer;
        Some(EngineError::Stranded {
            worker: workers[wi],
            layer,
            name: book.layers()[layer as usize].name.clone(),
            iter,
        })
    }

    pub(super) fn check_shutdown(&mut self) {
        if !self.life.ready() || !self.life.shutdown() || self.life == Life::Done {
            return;
        }
        let world = self.peers.len() as u32;
        let me = self.rank;
        if self.life < Life::FinishedSent {
            let idle = match &self.worker {
                None => true,
                Some(w) => {
                    (0..self.book.layers().len() as u32).all(|l| !w.core.is_in_flight(l))
                        && !w.forming.contains(&true)
                        && !self.parked_in.iter().any(Option::is_some)
                        && w.core.bytes_in_flight() == 0
                        && self.pending_jobs(Queue::Worker) == 0
                }
            };
            if !idle {
                return;
            }
            self.life.advance(Life::FinishedSent);
            self.any_finished = true;
            self.stranded_dirty = true;
            if self.worker.is_some() {
                for p in (0..world).filter(|&p| p != me) {
                    let writes = self.imm_sent[p as usize];
                    self.send_ctrl(p, &Msg::Finished { writes });
                }
            }
        }
        if self.life < Life::ByeSent {
            let server_done = match &self.server {
                None => true,
                Some(s) => {
                    let workers_done = self.book.cluster().workers().iter().all(|&w| {
                        w == self.rank
                            || self.peers[w as usize].lost
                            || self.peer_done(w, self.peers[w as usize].finished)
                    });
                    workers_done
                        && s.core.is_quiet()
                        && s.apply_running.is_empty()
                        && s.deferred.is_empty()
                        && s.credit_out.is_empty()
                        && self.pending_jobs(Queue::Server) == 0
                }
            };
            if !server_done {
                return;
            }
            self.life.advance(Life::ByeSent);
            for p in (0..world).filter(|&p| p != me) {
                let writes = self.imm_sent[p as usize];
                self.send_ctrl(p, &Msg::Bye { writes });
            }
        }
        let everyone = (0..world)
            .all(|p| p == self.rank || self.peers[p as usize].lost || self.peer_done(p, self.peers[p as usize].bye));
        if everyone && self.flow.idle() && self.jobs.is_empty() {
            // Server jobs handed out or queued are jobs too.
            debug_assert!(self.srv_out == 0 && self.srv_queue.is_empty() && self.srv_jobs.is_empty());
            // The worker drained before it said `Finished`, and took no hand-in since.
            debug_assert!(self.worker.as_ref().map_or(true, |w| {
                (0..self.book.layers().len() as u32).all(|l| !w.core.is_in_flight(l))
            }));
            self.life.advance(Life::Done);
            self.out.push_back(Output::Finished);
        }
    }

    /// The connection to `peer` ended (`error`: why, `None` when closed
    /// gracefully): fine after its goodbye or its loss (what was on its way
    /// to it counts as delivered), the loss of a worker the trigger goes on
    /// without, and otherwise the loss of the peer.
    pub(super) fn peer_closed(&mut self, peer: u32, error: Option<String>) -> Result<()> {
        self.stranded_dirty = true;
        let p = self.peer_mut(peer)?;
        p.closed = true;
        if p.bye.is_some() || p.lost {
            // It needs nothing more: what was still on its way to it
            // (a peer that died after its goodbye) counts as delivered.
            for track in self.flow.drop_peer(peer) {
                self.tx_done(track)?;
            }
            debug_assert_eq!(self.flow.pending_to(peer), 0, "nothing goes to rank {peer} any more");
            return Ok(());
        }
        if self.may_lose(peer) {
            return self.lose_worker(peer);
        }
        Err(EngineError::PeerLost {
            rank: peer,
            reason: match error {
                Some(e) => e,
                None => "it closed the connection without saying goodbye (did the process exit?)".into(),
            },
        })
    }
}
