//! Setting a rank up, in order: the rendezvous host (rank 0), the transport
//! and its listener, the Node with the limits the transport takes, the
//! regions the Node asks for (the caller's memory where it gave some), the
//! executors, the rendezvous that gives every peer's address, and the dials.

use super::*;
use tidewire_engine::node::{HeldTransmits, NodeConfig};
use tidewire_transport::{JobSecret, TcpConfig};

impl Runtime {
    pub(super) fn setup(
        mut cfg: Config,
        book: Arc<Book>,
        spec: &ClusterSpec,
        shared: Arc<Shared>,
        rx: Receiver<Request>,
    ) -> Result<Self> {
        let rank = spec.rank;
        let world = book.cluster().world();
        let role = book.cluster().role(rank).expect("checked by the builder");
        let secret = cfg.secret.clone().expect("set by build");
        let host = if rank == 0 && world > 1 {
            Some(rendezvous::Host::bind(spec.master)?)
        } else {
            None
        };
        let selected = open_transport(&cfg, rank, &secret)?;
        tracing::info!(rank, transport = selected.kind, reason = %selected.reason, "transport");
        shared.set_transport(selected.kind, &selected.reason);
        let mut t = selected.transport;
        let waker = t.waker()?;
        shared.set_waker(waker.clone());
        let ip = match cfg.listen_ip {
            Some(ip) => ip,
            None => rendezvous::local_ip_towards(spec.master)?,
        };
        let listener = t.listen(SocketAddr::new(ip, 0))?;
        let me = t.listener_addr(listener)?;

        let nc = node_config(&cfg, &book, rank, role.is_worker(), selected.kind, t.properties());
        let mut node = Node::new(nc)?;
        if cfg.rejoin {
            // A replacement: no seeding; the servers send it the current values.
            node.rejoin()?;
        }
        let (mem, key_region) = register(&mut *t, &mut node, &book, &mut cfg)?;
        let mem = Arc::new(mem);

        let (jobs_tx, jobs) = crossbeam_channel::unbounded();
        let reply = Reply {
            tx: jobs_tx,
            waker,
            panic: shared.panic.clone(),
        };
        let server = role.is_server().then(|| ServerSetup {
            policy: cfg.aggregation,
            windows: node.windows(),
            shard_len: book.shard_len(rank),
        });
        let momentum = snapshot::WorkerMomentum::default();
        let (ex, describe) = Executors::start(
            book.clone(),
            (cfg.op, cfg.sched.learners),
            mem.clone(),
            server,
            role.is_worker(),
            reply,
            rank,
            &cfg.ckpt,
            momentum.clone(),
        )?;
        let snap = cfg
            .ckpt
            .writer
            .clone()
            .filter(|w| w.plan().model_writer)
            .map(|w| snapshot::ModelSnap::new(w, momentum));
        if let Some(d) = describe {
            tracing::info!(rank, "{d}");
        }

        let (addrs, rejoins) = meet(host, &cfg, &secret, spec, world, me, &node)?;
        let mut dialing = HashMap::new();
        // Each rank dials the ranks below it; a replacement dials every rank
        // (the others are long past dialing).
        let dial = if cfg.rejoin { world } else { rank as usize };
        for (j, addr) in addrs.iter().enumerate().take(dial) {
            if j as u32 != rank {
                dialing.insert(t.connect(*addr)?, j as u32);
            }
        }
        let nl = book.layers().len();
        Ok(Runtime {
            t,
            node,
            rank,
            mem,
            ex,
            jobs,
            rx,
            shared,
            epoch: Instant::now(),
            conn_of: vec![None; world],
            rank_of: HashMap::new(),
            dialing,
            peer_keys: vec![None; world],
            peer_regions: vec![[None; 3]; world],
            peer_known: vec![false; world],
            key_region,
            reqs: HashMap::new(),
            held: vec![Held::User; if role.is_worker() { nl } else { 0 }],
            synced_at: vec![None; nl],
            waiters: HashMap::new(),
            wait_all: None,
            ready: None,
            shutdown: None,
            fatal: None,
            finished: false,
            hand_in_at: None,
            latencies: VecDeque::new(),
            hand_in_posts: 0,
            would_block: 0,
            refused: HeldTransmits::new(world),
            evs: Vec::with_capacity(512),
            _rejoins: rejoins,
            snap,
            adapt: (book.cluster().workers().first() == Some(&rank))
                .then(|| tidewire_engine::adapt::Adapt::new(&book))
                .flatten(),
            decisions_seen: 0,
            book,
        })
    }
}

/// The transport the configuration asks for (RDMA, io_uring TCP, portable
/// TCP), with the runtime's timeouts and the environment's limits.
fn open_transport(cfg: &Config, rank: u32, secret: &JobSecret) -> Result<select::Selected> {
    let limits = cfg.limits.from_env()?;
    let mut tcp = TcpConfig::new(cfg.job, rank, secret.clone());
    // The runtime sleeps in `wait` until there is work: no spinning.
    tcp.busy_poll = Duration::ZERO;
    // Its loop comes back to `wait` until it sleeps there, so Acks may wait for
    // the next control frame (a Credit) or for the sleep.
    tcp.lazy_acks = true;
    tcp.peer_timeout = cfg.timeout;
    // The handshake keeps its own short deadline (unauthenticated peers hold
    // resources until it passes); the connect timeout only shortens it.
    tcp.handshake_timeout = tcp.handshake_timeout.min(cfg.connect_timeout);
    if let Some(n) = limits.max_outstanding {
        tcp.max_outstanding = n;
    }
    if let Some(n) = limits.max_message_bytes {
        tcp.max_message_bytes = n;
    }
    #[cfg(feature = "rdma")]
    let tweak = move |c: &mut tidewire_transport::RdmaConfig| {
        if let Some(n) = limits.max_message_bytes {
            c.max_message_bytes = n;
        }
    };
    #[cfg(not(feature = "rdma"))]
    let tweak = |_: &mut ()| {};
    select::open(preference(cfg.transport), tcp, &tweak).map_err(|e| match e {
        tidewire_transport::Error::RdmaUnavailable { reason } => Error::TransportUnavailable(format!(
            "RDMA was requested but is unavailable: {reason}; use TIDEWIRE_TRANSPORT=tcp or auto"
        )),
        o => o.into(),
    })
}

/// The Node's configuration: the job's, the transport's limits, the
/// caller's buffer layouts, and (on a worker with sparse layers) this
/// machine's measured sparse costs.
fn node_config(
    cfg: &Config,
    book: &Arc<Book>,
    rank: u32,
    worker: bool,
    kind: &str,
    props: &tidewire_transport::Properties,
) -> NodeConfig {
    let mut nc = NodeConfig::new(book.clone(), rank);
    nc.sched = cfg.sched;
    nc.apply = cfg.op;
    nc.comm = cfg.comm;
    nc.checkpoint = cfg.ckpt.fingerprint;
    nc.limits = Limits {
        max_outstanding: props.max_outstanding,
        max_message_bytes: props.max_message_bytes,
        max_write_bytes: props.max_write_bytes,
    };
    // What every rank must agree on is the wire protocol: the io_uring and the
    // portable TCP backends speak the same one, so a job may mix them.
    nc.transport = match kind {
        "portable" => "tcp".to_string(),
        k => k.to_string(),
    };
    let offsets = |l: &crate::buffers::BufferLayout| l.offsets.iter().map(|&o| o as u64).collect();
    nc.params = cfg.params.as_ref().map(offsets);
    nc.grads = cfg.grads.as_ref().map(offsets);
    nc.startup_timeout = cfg.connect_timeout;
    let sparse_len = book
        .slices()
        .iter()
        .filter(|s| book.layers()[s.layer as usize].sparse)
        .map(|s| s.len)
        .max();
    if let (true, Some(len)) = (worker, sparse_len) {
        // The sparse threshold is measured: this machine's encode and
        // densify costs, against the link's speed.
        let env = std::env::var("TIDEWIRE_LINK_GBPS")
            .ok()
            .and_then(|v| v.trim().parse::<f64>().ok());
        let gbps = env
            .or(cfg.link_gbps)
            .or(props.speed_mbps.map(|m| m as f64 / 1000.0))
            .filter(|g| *g > 0.0)
            .unwrap_or(10.0);
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(8);
        nc.sparse = tidewire_gpu::cpu::calibrate_sparse(len, threads, gbps * 1e9 / 8.0);
        tracing::info!(rank, costs = ?nc.sparse, threshold = nc.sparse.threshold(len), "sparse push");
    }
    nc
}

/// Registers the regions the Node asks for (the caller's parameter and
/// gradient buffers where it gave them, pinned memory of ours otherwise),
/// writes the initial values, and tells the Node their keys. Returns the
/// memory and the remote-writable regions by key.
fn register(
    t: &mut dyn Transport,
    node: &mut Node,
    book: &Book,
    cfg: &mut Config,
) -> Result<(Memory, HashMap<u32, LocalRegion>)> {
    let mut user_params = cfg.params.take().map(|l| l.buffer);
    let mut user_grads = cfg.grads.take().map(|l| l.buffer);
    let staged = node.is_staged();
    let mut mem = Memory::default();
    let mut key_region = HashMap::new();
    for r in LocalRegion::ALL {
        let bytes = node.region_bytes(r) as usize;
        if bytes == 0 {
            continue;
        }
        let buf = match r {
            LocalRegion::Params if !staged => user_params.take(),
            LocalRegion::View => user_params.take(),
            LocalRegion::Grads => user_grads.take(),
            _ => None,
        };
        let (buf, ours) = match buf {
            Some(b) => (b, false),
            None => (pinned(bytes)?, true),
        };
        let access = if r.remote_write() {
            Access::REMOTE_WRITE
        } else {
            Access::LOCAL
        };
        let region = t.register(buf, access)?;
        if ours {
            // Fault our own pages in now, so the first iteration does not pay for
            // them. The caller's memory keeps its values: they are its initial ones.
            region.fill(0, region.len(), 0)?;
        }
        if r.remote_write() {
            key_region.insert(region.key(), r);
        }
        mem.insert(r, region);
    }
    if let (true, Some(view), Some(params)) = (staged, mem.region(LocalRegion::View), mem.region(LocalRegion::Params)) {
        // Under SSP the caller's buffer is the view; the initial values go out from the landing copy.
        for (i, l) in book.layers().iter().enumerate() {
            let v = node.layer_locs(i as u32).expect("worker").0;
            let p = node.params_loc(i as u32).expect("worker");
            let src = view.lease(v.offset as usize, l.params() * 4)?;
            let mut dst = params.lease(p.offset as usize, l.params() * 4)?;
            dst.as_bytes_mut().copy_from_slice(src.as_bytes());
        }
    }
    if let (Some(init), Some(params)) = (&cfg.init, mem.region(LocalRegion::Params)) {
        for (i, l) in book.layers().iter().enumerate() {
            let at = node.params_loc(i as u32).expect("worker");
            let mut lease = params.lease(at.offset as usize, l.params() * 4)?;
            init(i as u32, lease.as_f32_mut()?);
        }
    }
    let key = |r| mem.region(r).map_or(0, Region::key);
    node.set_keys([
        key(LocalRegion::Params),
        key(LocalRegion::Shard),
        key(LocalRegion::Landing),
    ]);
    Ok((mem, key_region))
}

/// Every rank's listener address, by rank: rank 0 hosts the rendezvous
/// (and, under a trigger other than `All`, keeps answering replacements),
/// the others join it.
fn meet(
    host: Option<rendezvous::Host>,
    cfg: &Config,
    secret: &JobSecret,
    spec: &ClusterSpec,
    world: usize,
    me: SocketAddr,
    node: &Node,
) -> Result<(Vec<SocketAddr>, Option<rendezvous::Rejoins>)> {
    let rank = spec.rank;
    match host {
        Some(h) => {
            let addrs = h.run(secret, cfg.job, world, me, node.job_config(), cfg.connect_timeout)?;
            let mut rejoins = None;
            if cfg.sched.trigger != tidewire_engine::Trigger::All {
                // Under these triggers a lost worker may be replaced: rank 0
                // keeps answering replacements with the address table.
                rejoins = Some(h.serve_rejoins(secret.clone(), cfg.job, addrs.clone(), node.job_config().clone())?);
            }
            Ok((addrs, rejoins))
        }
        None if world > 1 => Ok((
            rendezvous::join(
                spec.master,
                secret,
                cfg.job,
                rank,
                world,
                me,
                node.job_config(),
                cfg.connect_timeout,
            )?,
            None,
        )),
        None => Ok((vec![me], None)),
    }
}
