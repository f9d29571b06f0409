//! Configuration and counters of the RDMA backend, and path-MTU codes.

use sideway::ibverbs::device_context::Mtu;

use crate::error::{Error, Result};
use crate::frame;
use crate::tcp::TcpConfig;

use super::device::DeviceChoice;
use super::state::CTRL_CELL;

/// How completions are waited for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CqMode {
    /// Spin on the completion queue for the whole of `wait` (lowest latency, one core).
    BusyPoll,
    /// Spin for `control.busy_poll`, then sleep on the completion channel and the
    /// control plane's ring.
    Event,
}

/// How an RC queue pair reaches RTS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectMode {
    /// QPN, PSN, GID/LID and MTU travel over the authenticated TCP control plane,
    /// and each side moves its QP INIT -> RTR -> RTS itself (as `ibv_rc_pingpong`).
    ControlPlane,
    /// rdma_cm resolves the route from the peer's IP address and supplies the
    /// RTR/RTS attributes (as perftest's `-R`); the CM listens on the TCP
    /// listener's port number in the RDMA port space. The control plane still
    /// authenticates and carries the rest.
    RdmaCm,
}

/// Configuration of an [`RdmaTransport`](super::RdmaTransport).
///
/// The queue-pair defaults follow perftest's: `timeout` 14 (4.096 µs x 2^14 =
/// 67 ms per try), `retry_cnt` 7, `rnr_retry` 7, `min_rnr_timer` 12 (0.64 ms),
/// and the port's active MTU (at most 4096).
#[derive(Debug, Clone)]
pub struct RdmaConfig {
    /// The control plane: job id, rank, secret, handshake and peer timeouts, and
    /// `max_outstanding` (requests per connection before `WouldBlock`).
    pub control: TcpConfig,
    /// Device, port and GID.
    pub device: DeviceChoice,
    /// Path MTU in bytes (256..4096); `None` takes the port's active MTU.
    pub mtu: Option<u32>,
    /// Local ACK timeout exponent (4.096 µs x 2^timeout), 1..=31.
    pub timeout: u8,
    /// Transport retries before IBV_WC_RETRY_EXC_ERR, 0..=7.
    pub retry_cnt: u8,
    /// RNR retries, 0..=7 (7 = infinite). Credits keep receivers ahead anyway.
    pub rnr_retry: u8,
    /// RNR NAK timer code (12 = 0.64 ms).
    pub min_rnr_timer: u8,
    /// Send work requests in flight per queue pair.
    pub tx_depth: u32,
    /// Receives posted per connection (the peer's send credits).
    pub rx_depth: u32,
    /// Signal one send work request in this many (and the last of each batch).
    pub signal_every: u32,
    /// Largest message (receive buffer size).
    pub max_message_bytes: usize,
    /// Payloads up to this size are copied into the work request (IBV_SEND_INLINE).
    /// 0 (the default) keeps every payload zero-copy.
    pub max_inline_bytes: u32,
    /// Completion queue entries shared by all connections.
    pub cq_entries: u32,
    /// Busy-poll or event-driven completions.
    pub cq_mode: CqMode,
    /// How queue pairs are brought up: by the control-plane exchange (default) or
    /// through rdma_cm (`TIDEWIRE_RDMA_CM=1`, like perftest's `-R`).
    pub connect: ConnectMode,
    /// Refuse writes to descriptors the peer has not announced (stale or forged)
    /// before they reach the device. Off, the target's device is the only check,
    /// and a refused write fails the connection (IBV_WC_REM_ACCESS_ERR).
    pub verify_descriptors: bool,
}

impl RdmaConfig {
    /// Defaults for a job; the device is chosen automatically.
    pub fn new(control: TcpConfig) -> Self {
        RdmaConfig {
            control,
            device: DeviceChoice::default(),
            mtu: None,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 12,
            tx_depth: 128,
            rx_depth: 64,
            signal_every: 16,
            max_message_bytes: 64 * 1024,
            max_inline_bytes: 0,
            cq_entries: 16384,
            cq_mode: CqMode::Event,
            connect: ConnectMode::ControlPlane,
            verify_descriptors: true,
        }
    }

    /// Applies `TIDEWIRE_RDMA_DEVICE`, `_PORT`, `_GID_INDEX` and `TIDEWIRE_RDMA_CQ=busy|event`.
    pub fn from_env(mut self) -> Result<Self> {
        self.device = self.device.from_env()?;
        match std::env::var("TIDEWIRE_RDMA_CM").ok().as_deref() {
            None | Some("") | Some("0") => {}
            Some("1") => self.connect = ConnectMode::RdmaCm,
            Some(o) => {
                return Err(Error::InvalidArgument {
                    op: "TIDEWIRE_RDMA_CM",
                    reason: format!("{o:?}: use 1 (rdma_cm) or 0 (control plane)"),
                })
            }
        }
        match std::env::var("TIDEWIRE_RDMA_CQ").ok().as_deref() {
            None | Some("") => {}
            Some("busy") => self.cq_mode = CqMode::BusyPoll,
            Some("event") => self.cq_mode = CqMode::Event,
            Some(o) => {
                return Err(Error::InvalidArgument {
                    op: "TIDEWIRE_RDMA_CQ",
                    reason: format!("{o:?}: use busy or event"),
                })
            }
        }
        Ok(self)
    }

    pub(super) fn validate(&self) -> Result<()> {
        let bad = |reason: String| {
            Err(Error::InvalidArgument {
                op: "RdmaConfig",
                reason,
            })
        };
        if let Some(m) = self.mtu {
            if mtu_from_bytes(m).is_none() {
                return bad(format!("mtu {m}: use 256, 512, 1024, 2048 or 4096"));
            }
        }
        if !(1..=31).contains(&self.timeout) || self.retry_cnt > 7 || self.rnr_retry > 7 || self.min_rnr_timer > 31 {
            return bad("timeout must be 1..=31, retry_cnt and rnr_retry 0..=7, min_rnr_timer 0..=31".into());
        }
        if self.tx_depth < 2 || self.rx_depth < 2 || self.signal_every == 0 || self.signal_every > self.tx_depth {
            return bad("tx_depth and rx_depth must be at least 2, signal_every 1..=tx_depth".into());
        }
        if self.max_message_bytes == 0 || self.max_message_bytes > frame::MAX_MESSAGE_BYTES as usize {
            return bad(format!("max_message_bytes must be 1..={}", frame::MAX_MESSAGE_BYTES));
        }
        if self.control.max_outstanding == 0 {
            return bad("control.max_outstanding must be at least 1".into());
        }
        if self.control.max_message_bytes < CTRL_CELL {
            // The control plane's own messages (QP info, region lists, ABORT reasons) take
            // up to one cell; a lower cap would drop them (a region list never arrives).
            return bad(format!(
                "control.max_message_bytes must be at least {CTRL_CELL} (it bounds the control plane's \
                 own messages; RDMA messages are bounded by max_message_bytes)"
            ));
        }
        Ok(())
    }
}

pub(super) fn mtu_from_bytes(b: u32) -> Option<Mtu> {
    Some(match b {
        256 => Mtu::Mtu256,
        512 => Mtu::Mtu512,
        1024 => Mtu::Mtu1024,
        2048 => Mtu::Mtu2048,
        4096 => Mtu::Mtu4096,
        _ => return None,
    })
}

pub(super) fn mtu_code(m: Mtu) -> u8 {
    match m {
        Mtu::Mtu256 => 1,
        Mtu::Mtu512 => 2,
        Mtu::Mtu1024 => 3,
        Mtu::Mtu2048 => 4,
        Mtu::Mtu4096 => 5,
    }
}

pub(super) fn mtu_of_code(c: u8) -> Mtu {
    match c {
        1 => Mtu::Mtu256,
        2 => Mtu::Mtu512,
        3 => Mtu::Mtu1024,
        4 => Mtu::Mtu2048,
        _ => Mtu::Mtu4096,
    }
}

/// Counters of the RDMA data path.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RdmaStats {
    /// Payload bytes the device moved from registered memory (writes, reads, sends).
    pub tx_payload_bytes: u64,
    /// Payload bytes copied by the CPU into work requests (inline). 0 unless
    /// `max_inline_bytes` is set.
    pub tx_inline_payload_bytes: u64,
    /// Bytes of received messages copied out of the receive buffers into `Event::Message`.
    pub rx_message_copy_bytes: u64,
    /// Payload bytes of peers' writes with an immediate that landed here (no host copy).
    pub rx_write_bytes: u64,
    /// Doorbells (`ibv_wr_complete` calls) and the work requests they posted.
    pub doorbells: u64,
    pub work_requests: u64,
    /// Signalled work requests.
    pub signalled: u64,
    /// Times a receive-consuming post waited for the peer's credits.
    pub credit_stalls: u64,
    /// Receive credits returned to the peer: inline RDMA WRITEs of the credit
    /// word, each its own doorbell (not in `doorbells` or `work_requests`).
    pub credit_writes: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_validation() {
        let base = RdmaConfig::new(TcpConfig::new(1, 0, crate::JobSecret::new(b"s".to_vec())));
        assert!(base.validate().is_ok());
        for f in [
            |c: &mut RdmaConfig| c.mtu = Some(1500),
            |c: &mut RdmaConfig| c.timeout = 0,
            |c: &mut RdmaConfig| c.retry_cnt = 8,
            |c: &mut RdmaConfig| c.rx_depth = 1,
            |c: &mut RdmaConfig| c.signal_every = 0,
            |c: &mut RdmaConfig| c.signal_every = 1000,
            |c: &mut RdmaConfig| c.max_message_bytes = 0,
            |c: &mut RdmaConfig| c.control.max_message_bytes = 1024,
        ] {
            let mut c = base.clone();
            f(&mut c);
            assert!(matches!(c.validate(), Err(Error::InvalidArgument { .. })), "{c:?}");
        }
        std::env::set_var("TIDEWIRE_RDMA_CQ", "sometimes");
        let e = base.clone().from_env().unwrap_err();
        std::env::remove_var("TIDEWIRE_RDMA_CQ");
        assert!(e.to_string().contains("busy or event"), "{e}");
    }
}
