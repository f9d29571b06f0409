//! The [`RdmaTransport`] itself: the device context and what hangs off it
//! (protection domain, completion queue and channel, the inner TCP control
//! plane), construction, accessors, and one progress step.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionChannel};
use sideway::ibverbs::device_context::Mtu;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use tracing::info;

use crate::api::{ConnId, Event, PeerInfo, Properties, ReqId, Transport, WakeFd};
use crate::error::Result;
use crate::memory::{Access, MemoryKind, PinOptions, PinnedBuffer, Region};
use crate::tcp::TcpTransport;

use super::cm;
use super::config::{mtu_from_bytes, ConnectMode, CqMode, RdmaConfig, RdmaStats};
use super::device::{self, Dmabuf};
use super::error::{io_of, verbs};
use super::state::{Conn, Op, Registered, State, Wr, CTRL_CELL, CTRL_CELLS};

/// The RDMA verbs transport; see the module docs.
pub struct RdmaTransport {
    // Field order is drop order: queue pairs before the memory regions they
    // use, before the CQ, the PD and the device context.
    pub(super) conns: HashMap<u64, Conn>,
    pub(super) regions: HashMap<u32, Registered>,
    /// Live dmabuf regions by rkey, with their length: targets a write notice
    /// may name besides `regions` (their owner is the caller's `DmabufRegion`).
    pub(super) dmabuf_targets: HashMap<u32, (u64, std::sync::Weak<sideway::ibverbs::memory_region::MemoryRegion>)>,
    pub(super) ctrl_cells: Vec<usize>,
    pub(super) ctrl_inflight: HashMap<ReqId, usize>,
    pub(super) ctrl_backlog: VecDeque<(u64, u32, Vec<u8>)>,
    pub(super) ctrl: Region,
    pub(super) inner: TcpTransport,
    pub(super) cq: Arc<BasicCompletionQueue>,
    pub(super) channel: Option<Arc<CompletionChannel>>,
    pub(super) armed: bool,
    pub(super) pd: Arc<ProtectionDomain>,
    pub(super) dev: device::Selected,
    pub(super) mtu: Mtu,
    pub(super) cfg: RdmaConfig,
    pub(super) props: Properties,
    pub(super) events: VecDeque<Event>,
    pub(super) accepted: HashMap<u64, VecDeque<(ConnId, PeerInfo)>>,
    pub(super) next_req: u64,
    pub(super) generation: u32,
    pub(super) dmabuf: Option<Dmabuf>,
    pub(super) stats: RdmaStats,
    /// rdma_cm state, in [`ConnectMode::RdmaCm`].
    pub(super) cm: Option<cm::Cm>,
    /// The [`Waker`](crate::Waker)'s eventfd and flag; `sleep` polls the eventfd.
    pub(super) wake: Arc<WakeFd>,
    /// Lists a progress step fills and empties, kept (with their capacity) so
    /// that steady progress allocates nothing: the inner transport's events,
    /// the connections with work to post, and one connection's batch.
    pub(super) inner_events: Vec<Event>,
    pub(super) post_ids: Vec<u64>,
    /// Some connection waits for receive credits. They come back as RDMA WRITEs,
    /// which wake nothing here, so `sleep` then naps briefly instead of blocking.
    pub(super) credit_stalled: bool,
    pub(super) post_batch: Vec<(Op, Wr)>,
}

impl std::fmt::Debug for RdmaTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmaTransport")
            .field("device", &self.dev.name)
            .field("port", &self.dev.port)
            .field("gid_index", &self.dev.gid_index)
            .field("connections", &self.conns.len())
            .field("regions", &self.regions.len())
            .finish()
    }
}

impl RdmaTransport {
    /// Opens the device, allocates the protection domain and completion queue,
    /// and starts the control plane. Fails with [`Error::RdmaUnavailable`](crate::Error::RdmaUnavailable) when
    /// libibverbs, a device or an ACTIVE port is missing.
    pub fn new(cfg: RdmaConfig) -> Result<Self> {
        cfg.validate()?;
        let dev = device::select(&cfg.device)?;
        let name = dev.name.clone();
        let pd = dev.ctx.alloc_pd().map_err(|e| verbs("ibv_alloc_pd", &name, io_of(e)))?;
        let (channel, cq) = create_cq(&dev, &cfg)?;
        let mtu = match cfg.mtu {
            Some(m) => mtu_from_bytes(m).expect("validated"),
            None => dev.active_mtu,
        };
        let cm = match cfg.connect {
            ConnectMode::ControlPlane => None,
            ConnectMode::RdmaCm => Some(cm::Cm::new(&name)?),
        };
        let inner = TcpTransport::new(cfg.control.clone())?;
        let mut inner = inner;
        let ctrl = inner.register(
            PinnedBuffer::with_options(
                CTRL_CELL * CTRL_CELLS,
                PinOptions {
                    lock: false,
                    ..Default::default()
                },
            )?,
            Access::LOCAL,
        )?;
        let wake = WakeFd::new()?;
        let props = properties(&dev, &cfg);
        info!(
            device = %dev.name, port = dev.port, gid_index = dev.gid_index, gid = %dev.gid,
            mtu = device::mtu_bytes(mtu), "RDMA transport ready"
        );
        Ok(RdmaTransport {
            conns: HashMap::new(),
            regions: HashMap::new(),
            dmabuf_targets: HashMap::new(),
            ctrl_cells: (0..CTRL_CELLS).rev().collect(),
            ctrl_inflight: HashMap::new(),
            ctrl_backlog: VecDeque::new(),
            ctrl,
            inner,
            cq,
            channel,
            armed: false,
            pd,
            dev,
            mtu,
            cfg,
            props,
            events: VecDeque::new(),
            accepted: HashMap::new(),
            next_req: 1,
            generation: 1,
            dmabuf: None,
            stats: RdmaStats::default(),
            cm,
            wake,
            inner_events: Vec::new(),
            post_ids: Vec::new(),
            credit_stalled: false,
            post_batch: Vec::new(),
        })
    }

    /// The device, port and GID index in use.
    pub fn device(&self) -> (&str, u8, u32) {
        (&self.dev.name, self.dev.port, self.dev.gid_index)
    }

    /// The path MTU in bytes.
    pub fn mtu_bytes(&self) -> u32 {
        device::mtu_bytes(self.mtu)
    }

    /// Data-path counters.
    pub fn stats(&self) -> RdmaStats {
        self.stats
    }

    /// Testing aid: destroys this side's queue pair of `conn` while its control
    /// connection stays up, as a crashed NIC or a dead host would look to the peer.
    #[doc(hidden)]
    pub fn debug_drop_qp(&mut self, conn: ConnId) {
        if let Some(c) = self.conns.get_mut(&conn.0) {
            c.qp = None;
            c.state = State::Dead;
        }
    }

    pub(super) fn progress(&mut self) -> Result<()> {
        let mut inner_events = std::mem::take(&mut self.inner_events);
        inner_events.clear();
        let polled = self.inner.poll(&mut inner_events, 1024).and_then(|_| self.poll_cq());
        if polled.is_ok() {
            for ev in inner_events.drain(..) {
                self.on_inner(ev);
            }
        }
        self.inner_events = inner_events;
        polled?;
        if self.cm.is_some() {
            self.poll_cm();
        }
        self.return_credits();
        self.post_pending();
        self.flush_ctrl();
        self.housekeeping();
        Ok(())
    }

    pub(super) fn drain(&mut self, events: &mut Vec<Event>, max: usize) -> usize {
        let n = self.events.len().min(max);
        events.extend(self.events.drain(..n));
        n
    }
}

/// The completion queue of `cfg.cq_entries` on device `dev`, and in event mode
/// the (non-blocking) completion channel it signals.
fn create_cq(
    dev: &device::Selected,
    cfg: &RdmaConfig,
) -> Result<(Option<Arc<CompletionChannel>>, Arc<BasicCompletionQueue>)> {
    let name = &dev.name;
    let channel = match cfg.cq_mode {
        CqMode::Event => {
            let ch = dev
                .ctx
                .create_comp_channel()
                .map_err(|e| verbs("ibv_create_comp_channel", name, io_of(e)))?;
            ch.set_nonblocking(true)
                .map_err(|e| verbs("fcntl(O_NONBLOCK) on the completion channel", name, e))?;
            Some(ch)
        }
        CqMode::BusyPoll => None,
    };
    let mut b = dev.ctx.create_cq_builder();
    b.setup_cqe(cfg.cq_entries);
    if let Some(ch) = &channel {
        b.setup_comp_channel(ch, 0);
    }
    // A basic CQ (ibv_poll_cq): the ibv_start_poll/ibv_next_poll/ibv_end_poll
    // batch of Debian 12's rxe provider advances its consumer index twice when a
    // batch ends on an empty queue, which loses completions and re-reads stale
    // ones (seen here as a duplicated message); ibv_poll_cq has no such state.
    let cq = b.build().map_err(|e| verbs("ibv_create_cq", name, io_of(e)))?;
    Ok((channel, cq))
}

/// What the transport tells its users about itself on device `dev`.
fn properties(dev: &device::Selected, cfg: &RdmaConfig) -> Properties {
    let max_write = dev.max_msg_sz.min(1 << 30) as usize;
    Properties {
        name: format!("rdma-verbs ({} port {} gid {})", dev.name, dev.port, dev.gid_index),
        speed_mbps: None,
        memory_kinds: vec![MemoryKind::Host, MemoryKind::DmaBuf],
        max_message_bytes: cfg.max_message_bytes,
        max_write_bytes: max_write,
        one_sided: true,
        max_outstanding: cfg.control.max_outstanding,
    }
}
