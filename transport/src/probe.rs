//! Run-time probes of what this machine offers the transports, for `tidewire doctor`.

use io_uring::{opcode, IoUring, Probe};

use crate::memory::memlock_limit;

/// One probed capability: whether it is usable, and why not.
#[derive(Debug, Clone)]
pub struct Capability {
    pub name: String,
    pub ok: bool,
    pub detail: String,
}

fn cap(name: &str, ok: bool, detail: impl Into<String>) -> Capability {
    Capability {
        name: name.into(),
        ok,
        detail: detail.into(),
    }
}

/// Whether the portable (epoll) TCP backend can be set up: it needs only epoll,
/// eventfd and sockets, so it works where io_uring is forbidden.
pub fn portable() -> Capability {
    let cfg = crate::TcpConfig::new(0, 0, crate::JobSecret::new(b"probe".to_vec()));
    match crate::PortableTransport::new(cfg) {
        Ok(_) => cap(
            "portable epoll TCP",
            true,
            "epoll and eventfd work: the fallback where io_uring is not allowed (TIDEWIRE_TRANSPORT=portable)",
        ),
        Err(e) => cap(
            "portable epoll TCP",
            false,
            format!("cannot set up the portable backend: {e}"),
        ),
    }
}

/// io_uring: setup, the opcodes the TCP backend uses, and provided-buffer rings.
pub fn io_uring() -> Vec<Capability> {
    let disabled = std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
        .ok()
        .map(|s| s.trim().to_string());
    let ring = match IoUring::new(8) {
        Ok(r) => r,
        Err(e) => return vec![io_uring_refused(disabled.as_deref(), &e)],
    };
    let mut out = vec![cap("io_uring", true, "io_uring_setup works")];
    match io_uring_opcodes(&ring) {
        Ok(caps) => out.extend(caps),
        Err(refused) => {
            out.push(refused);
            return out;
        }
    }
    out.push(io_uring_buf_ring(&ring));
    out
}

/// Why `io_uring_setup` failed with `e`, given `kernel.io_uring_disabled`.
fn io_uring_refused(disabled: Option<&str>, e: &std::io::Error) -> Capability {
    let why = match disabled {
        Some("2") => "kernel.io_uring_disabled=2 forbids io_uring; set it to 0".to_string(),
        Some("1") => {
            "kernel.io_uring_disabled=1 restricts io_uring to the io_uring_group; add this user or set it to 0".into()
        }
        _ => format!("io_uring_setup failed: {e} (seccomp in a container, or a kernel older than 5.19?)"),
    };
    cap("io_uring", false, why)
}

/// The opcodes the TCP backend uses, one capability each; the probe's failure
/// as the error.
fn io_uring_opcodes(ring: &IoUring) -> Result<Vec<Capability>, Capability> {
    let mut probe = Probe::new();
    if let Err(e) = ring.submitter().register_probe(&mut probe) {
        return Err(cap(
            "io_uring opcodes",
            false,
            format!("IORING_REGISTER_PROBE failed: {e}"),
        ));
    }
    let ops: [(&str, u8, &str); 8] = [
        ("ACCEPT (multishot)", opcode::AcceptMulti::CODE, "listening"),
        ("CONNECT", opcode::Connect::CODE, "connecting"),
        (
            "RECV (multishot + buffer ring)",
            opcode::RecvMulti::CODE,
            "control receives",
        ),
        ("SENDMSG", opcode::SendMsg::CODE, "gathered sends"),
        ("SEND", opcode::Send::CODE, "headers"),
        ("SEND_ZC", opcode::SendZc::CODE, "zero-copy sends above the threshold"),
        ("ASYNC_CANCEL", opcode::AsyncCancel2::CODE, "teardown"),
        ("READ_FIXED", opcode::ReadFixed::CODE, "fixed buffers"),
    ];
    let mut out = Vec::with_capacity(ops.len());
    for (name, code, used_for) in ops {
        let ok = probe.is_supported(code);
        let detail = if ok {
            format!("supported ({used_for})")
        } else {
            format!("missing: {used_for} cannot use it; a newer kernel is needed")
        };
        out.push(cap(&format!("io_uring {name}"), ok, detail));
    }
    Ok(out)
}

/// Whether `ring` takes a provided-buffer ring (5.19+): it tries one.
fn io_uring_buf_ring(ring: &IoUring) -> Capability {
    let br = crate::memory::PinnedBuffer::with_options(
        4096,
        crate::memory::PinOptions {
            lock: false,
            ..Default::default()
        },
    );
    let ok = match br {
        // SAFETY: `b` is page-aligned and large enough for 8 entries; the ring is
        // unregistered right after (and registration failing leaves nothing behind).
        Ok(ref b) => unsafe {
            ring.submitter()
                .register_buf_ring_with_flags(b.as_ptr() as u64, 8, 7, 0)
        }
        .map(|_| ring.submitter().unregister_buf_ring(7))
        .is_ok(),
        Err(_) => false,
    };
    cap(
        "io_uring provided-buffer ring",
        ok,
        if ok {
            "supported"
        } else {
            "IORING_REGISTER_PBUF_RING refused: Linux 5.19+ is needed"
        },
    )
}

/// RLIMIT_MEMLOCK, and what it means for pinned buffers.
pub fn memlock() -> Capability {
    let (lim, text) = memlock_limit();
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    match lim {
        None => cap("memlock limit", true, format!("{text}: any size can be pinned")),
        Some(_) if root => cap(
            "memlock limit",
            true,
            format!("{text}, but running as root (CAP_IPC_LOCK ignores the limit)"),
        ),
        Some(b) if b < (1 << 30) => cap(
            "memlock limit",
            false,
            format!(
                "{text}: pinned buffers beyond this fail. Raise it with `ulimit -l unlimited` (as root), \
                 a memlock line in /etc/security/limits.conf, or LimitMEMLOCK=infinity"
            ),
        ),
        Some(_) => cap("memlock limit", true, text),
    }
}

/// Transparent and hugetlbfs huge pages.
pub fn huge_pages() -> Vec<Capability> {
    let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    let mode = thp
        .split_whitespace()
        .find(|w| w.starts_with('['))
        .map(|w| w.trim_matches(|c| c == '[' || c == ']').to_string())
        .unwrap_or_else(|| "unavailable".into());
    let thp_ok = mode == "always" || mode == "madvise";
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |k: &str| {
        meminfo
            .lines()
            .find(|l| l.starts_with(k))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    let total = field("HugePages_Total:");
    let free = field("HugePages_Free:");
    vec![
        cap(
            "transparent huge pages",
            thp_ok,
            if thp_ok {
                format!("mode [{mode}]: buffers of 2 MiB and more ask for them with MADV_HUGEPAGE")
            } else {
                format!("mode [{mode}]: buffers use 4 KiB pages; enable with `echo madvise > /sys/kernel/mm/transparent_hugepage/enabled`")
            },
        ),
        cap(
            "hugetlbfs pool",
            total > 0,
            if total > 0 {
                format!("{free} of {total} huge pages free (HugePages::HugeTlb can use them)")
            } else {
                "vm.nr_hugepages is 0: HugePages::HugeTlb would fail; set it with `sysctl vm.nr_hugepages=N`".into()
            },
        ),
    ]
}

/// The RDMA backend: libibverbs, each device with its ports, states, GIDs and
/// dmabuf support, and what `Auto` would choose. Where nothing is usable, why.
pub fn rdma() -> Vec<Capability> {
    #[cfg(feature = "rdma")]
    {
        use crate::rdma::device;
        let list = match device::list() {
            Ok(l) => l,
            Err(e) => return vec![cap("rdma", false, format!("{e}; transport auto uses io_uring TCP"))],
        };
        if list.is_empty() {
            return vec![cap(
                "rdma",
                false,
                "libibverbs loads but finds no device (no HCA; soft-RoCE: `rdma link add rxe0 type rxe netdev eth0`); \
                 transport auto uses io_uring TCP",
            )];
        }
        let mut out = Vec::new();
        for d in &list {
            for p in &d.ports {
                out.push(rdma_port(d, p));
            }
            out.push(rdma_dmabuf(d));
            out.push(rdma_rate_limit(d));
        }
        let usable = list.iter().find(|d| d.usable);
        out.push(cap(
            "rdma (transport auto)",
            usable.is_some(),
            match usable {
                Some(d) => format!("auto picks RDMA on {}", d.name),
                None => "no device has an ACTIVE port with a usable GID; auto uses io_uring TCP".into(),
            },
        ));
        out
    }
    #[cfg(not(feature = "rdma"))]
    vec![cap(
        "rdma",
        false,
        "built without the `rdma` feature: rebuild with `--features rdma` to use verbs devices; TCP carries all traffic",
    )]
}

/// Port `p` of device `d`: usable when active; its state, link layer, MTU, lid and GIDs.
#[cfg(feature = "rdma")]
fn rdma_port(d: &crate::rdma::device::DeviceInfoSummary, p: &crate::rdma::device::PortInfo) -> Capability {
    let gids: Vec<String> = p
        .gids
        .iter()
        .map(|g| match g.ipv4 {
            Some(ip) => format!("[{}] {} {}", g.index, g.kind, ip),
            None => format!("[{}] {} {}", g.index, g.kind, g.gid),
        })
        .collect();
    cap(
        &format!("rdma {} port {}", d.name, p.port),
        p.active,
        format!(
            "{} {}, MTU {}, lid {}; GIDs: {}",
            p.state,
            p.link_layer,
            p.active_mtu,
            p.lid,
            if gids.is_empty() {
                "none".into()
            } else {
                gids.join(", ")
            }
        ),
    )
}

/// Whether device `d` registers dmabuf memory (GPUDirect RDMA), and if not why.
#[cfg(feature = "rdma")]
fn rdma_dmabuf(d: &crate::rdma::device::DeviceInfoSummary) -> Capability {
    use crate::rdma::device;
    match &d.dmabuf {
        device::Dmabuf::Supported => cap(
            &format!("rdma {} dmabuf", d.name),
            true,
            "ibv_reg_dmabuf_mr supported (GPUDirect RDMA through dmabuf)",
        ),
        device::Dmabuf::Unsupported(why) => cap(
            &format!("rdma {} dmabuf", d.name),
            false,
            format!("{why}; GPU buffers are staged through pinned host memory"),
        ),
    }
}

/// Whether device `d` rate-limits queue pairs, and if not why.
#[cfg(feature = "rdma")]
fn rdma_rate_limit(d: &crate::rdma::device::DeviceInfoSummary) -> Capability {
    use crate::rdma::device;
    match &d.rate_limit {
        device::RateLimit::Supported {
            min_kbps,
            max_kbps,
            qp_types,
        } => cap(
            &format!("rdma {} rate limit", d.name),
            true,
            format!(
                "ibv_modify_qp_rate_limit: {min_kbps}..{max_kbps} kbit/s per QP on {}",
                qp_types.join(", ")
            ),
        ),
        device::RateLimit::Unsupported(why) => cap(
            &format!("rdma {} rate limit", d.name),
            false,
            format!("{why}; shape RDMA with tc on its netdev instead (ci/netem, or the soft-RoCE VM's veth)"),
        ),
    }
}
