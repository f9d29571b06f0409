//! The server core's part in the kvstore placement ([`Placement::KvStore`]):
//! pulls answered in the order they came.

use super::*;

/// Bytes of broadcasts a server has out at once: the credit window, or
/// under kvstore one answer to every worker's pull of its largest part.
/// MXNet's server (ps-lite over ZMQ) answers each pull as it comes, on that
/// worker's own connection, and the answers share its link; with the
/// credit window a server sent its 51 MB part of VGG19's fc6 to one worker
/// after another, and each worker took its parts from the 8 servers in
/// turn. The answers are sent from the parameters (zero-copy), which stay
/// until every pull of the version is placed: no extra memory holds data.
pub(super) fn bcast_window(book: &Book, rank: u32, cfg: &SchedConfig) -> usize {
    if book.config().placement != Placement::KvStore {
        return cfg.credit_bytes;
    }
    let largest = book
        .server_chunks(rank)
        .iter()
        .map(|&c| book.chunks()[c as usize].len * 4)
        .max()
        .unwrap_or(0);
    cfg.credit_bytes.max(largest.saturating_mul(book.p1()))
}

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
