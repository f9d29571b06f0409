//! The server core's part in the kvstore placement ([`Placement::KvStore`]):
//! pulls answered in the order they came.

use super::*;

impl Server {
    /// Kvstore: `worker` pulls `chunk` at `version`, the version it was
    /// notified of. The values go to it in the order the pulls came
    /// (MXNet's server answers requests FIFO), within the broadcast window.
    pub fn handle_pull(&mut self, worker: u32, chunk: u32, version: u64) -> Result<()> {
        let wi = self
            .book
            .cluster()
            .worker_index(worker)
            .ok_or_else(|| self.err(worker, ProtocolViolation::PullFromNonWorker))?;
        if self.owed.is_empty() {
            return Err(self.err(worker, ProtocolViolation::PullNotKvstore));
        }
        let lc = self.local_chunk(worker, chunk)?;
        if !std::mem::take(&mut self.owed[lc * self.p1 + wi]) || version != self.applied[lc] {
            return Err(self.err(
                worker,
                ProtocolViolation::PullNotNotified {
                    chunk,
                    version,
                    at: self.applied[lc],
                },
            ));
        }
        debug_assert!(self.bcast_pending[lc] > 0, "a notified pull counts as pending");
        self.bcast_queue.push(Reverse((self.pull_seq, chunk, wi as u32)));
        self.pull_seq += 1;
        self.pump_broadcasts();
        Ok(())
    }
}
