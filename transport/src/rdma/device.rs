//! Device discovery, port and GID selection, and the probes `tidewire doctor`
//! shows. Nothing here panics when libibverbs or a device is missing: every
//! path ends in a typed error that says why.

use std::ffi::CString;
use std::net::Ipv4Addr;
use std::sync::Arc;

use sideway::ibverbs::address::{Gid, GidType};
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, LinkLayer, Mtu, PortState};
use sideway::ibverbs::protection_domain::ProtectionDomain;

use crate::error::{Error, Result};

/// Where to find the device, port and GID; `None` picks automatically.
#[derive(Debug, Clone, Default)]
pub struct DeviceChoice {
    /// Device name, e.g. `mlx5_0` or `rxe0` (`TIDEWIRE_RDMA_DEVICE`).
    pub device: Option<String>,
    /// Port number, from 1 (`TIDEWIRE_RDMA_PORT`).
    pub port: Option<u8>,
    /// GID index (`TIDEWIRE_RDMA_GID_INDEX`); automatic prefers a RoCE v2 IPv4-mapped GID.
    pub gid_index: Option<u32>,
}

impl DeviceChoice {
    /// Reads `TIDEWIRE_RDMA_DEVICE`, `TIDEWIRE_RDMA_PORT` and `TIDEWIRE_RDMA_GID_INDEX`
    /// over the values already set.
    pub fn from_env(mut self) -> Result<Self> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        if let Some(d) = var("TIDEWIRE_RDMA_DEVICE") {
            self.device = Some(d);
        }
        if let Some(p) = var("TIDEWIRE_RDMA_PORT") {
            self.port = Some(
                p.parse()
                    .ok()
                    .filter(|&p: &u8| p >= 1)
                    .ok_or_else(|| Error::InvalidArgument {
                        op: "TIDEWIRE_RDMA_PORT",
                        reason: format!("{p:?} is not a port number (1, 2, ...)"),
                    })?,
            );
        }
        if let Some(g) = var("TIDEWIRE_RDMA_GID_INDEX") {
            self.gid_index = Some(g.parse().map_err(|_| Error::InvalidArgument {
                op: "TIDEWIRE_RDMA_GID_INDEX",
                reason: format!("{g:?} is not a GID index"),
            })?);
        }
        Ok(self)
    }
}

/// Checks that libibverbs can be loaded at all, before any verbs call (the
/// stubs that sideway links answer EOPNOTSUPP without it, which says nothing).
/// Fails with [`Error::RdmaUnavailable`] saying what to install.
pub fn libibverbs_present() -> Result<()> {
    let name = CString::new("libibverbs.so.1").expect("no NUL");
    // SAFETY: dlopen with a valid C string; the handle is closed at once and no
    // symbol from it is used. Loading runs libibverbs' constructors, which the
    // verbs stubs do anyway.
    let h = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
    if h.is_null() {
        // SAFETY: dlerror returns a thread-local C string or null.
        let err = unsafe { libc::dlerror() };
        let why = if err.is_null() {
            "not found".to_string()
        } else {
            // SAFETY: non-null dlerror results are valid NUL-terminated strings.
            unsafe { std::ffi::CStr::from_ptr(err) }.to_string_lossy().into_owned()
        };
        return Err(Error::RdmaUnavailable {
            reason: format!(
                "libibverbs.so.1 cannot be loaded ({why}); install libibverbs1 and the provider \
                 (Debian: `apt-get install libibverbs1 ibverbs-providers`)"
            ),
        });
    }
    // SAFETY: `h` came from dlopen above and is closed once.
    unsafe { libc::dlclose(h) };
    Ok(())
}

/// One GID table entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GidInfo {
    pub index: u32,
    pub gid: String,
    /// `IB`, `RoCE v1` or `RoCE v2`.
    pub kind: &'static str,
    /// The IPv4 address of an IPv4-mapped GID.
    pub ipv4: Option<Ipv4Addr>,
}

/// One port of a device.
#[derive(Debug, Clone)]
pub struct PortInfo {
    pub port: u8,
    pub state: String,
    pub active: bool,
    pub link_layer: &'static str,
    pub active_mtu: u32,
    pub lid: u16,
    pub gids: Vec<GidInfo>,
}

/// Whether `ibv_reg_dmabuf_mr` (GPUDirect RDMA through dmabuf) works on a device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dmabuf {
    Supported,
    Unsupported(String),
}

/// Per-queue-pair rate limiting (`ibv_modify_qp_rate_limit`, "packet
/// pacing"), from the device's `packet_pacing_caps`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RateLimit {
    /// Rates from `min_kbps` to `max_kbps` on these queue-pair types.
    Supported {
        min_kbps: u32,
        max_kbps: u32,
        qp_types: Vec<&'static str>,
    },
    /// Why not.
    Unsupported(String),
}

/// Reads packet pacing from `ibv_query_device_ex`'s attributes.
pub fn rate_limit_of(min_kbps: u32, max_kbps: u32, supported_qpts: u32) -> RateLimit {
    if max_kbps == 0 || supported_qpts == 0 {
        return RateLimit::Unsupported(
            "the device reports no packet pacing (packet_pacing_caps are zero; soft-RoCE/rxe has none)".into(),
        );
    }
    // Bit n stands for enum ibv_qp_type value n.
    let names = [
        (2, "RC"),
        (3, "UC"),
        (4, "UD"),
        (8, "RAW_PACKET"),
        (9, "XRC_SEND"),
        (10, "XRC_RECV"),
    ];
    let qp_types = names
        .iter()
        .filter(|(bit, _)| supported_qpts & (1 << bit) != 0)
        .map(|(_, n)| *n)
        .collect();
    RateLimit::Supported {
        min_kbps,
        max_kbps,
        qp_types,
    }
}

/// A device as `tidewire doctor` shows it.
#[derive(Debug, Clone)]
pub struct DeviceInfoSummary {
    pub name: String,
    pub ports: Vec<PortInfo>,
    pub dmabuf: Dmabuf,
    /// Per-QP rate limiting (`ibv_modify_qp_rate_limit`).
    pub rate_limit: RateLimit,
    /// Whether any port is ACTIVE with a usable GID.
    pub usable: bool,
}

pub(crate) fn mtu_bytes(m: Mtu) -> u32 {
    match m {
        Mtu::Mtu256 => 256,
        Mtu::Mtu512 => 512,
        Mtu::Mtu1024 => 1024,
        Mtu::Mtu2048 => 2048,
        Mtu::Mtu4096 => 4096,
    }
}

pub(crate) fn ipv4_mapped(g: &Gid) -> Option<Ipv4Addr> {
    let r = g.raw;
    (r[..10].iter().all(|&b| b == 0) && r[10] == 0xff && r[11] == 0xff)
        .then(|| Ipv4Addr::new(r[12], r[13], r[14], r[15]))
}

fn gid_kind(t: GidType) -> &'static str {
    match t {
        GidType::InfiniBand => "IB",
        GidType::RoceV1 => "RoCE v1",
        GidType::RoceV2 => "RoCE v2",
    }
}

fn port_state_name(s: PortState) -> &'static str {
    match s {
        PortState::Nop => "NOP",
        PortState::Down => "DOWN",
        PortState::Initializing => "INIT",
        PortState::Armed => "ARMED",
        PortState::Active => "ACTIVE",
        PortState::ActiveDefer => "ACTIVE_DEFER",
    }
}

fn device_list() -> Result<DeviceList> {
    libibverbs_present()?;
    DeviceList::new().map_err(|e| {
        let errno = super::io_of(e);
        let why = if std::path::Path::new("/sys/class/infiniband").exists() {
            format!(
                "ibv_get_device_list failed: {errno} (is the ib_uverbs module loaded, and /dev/infiniband readable?)"
            )
        } else {
            format!(
                "this kernel shows no RDMA devices (/sys/class/infiniband is missing: no RDMA driver, or \
                 CONFIG_INFINIBAND is off); ibv_get_device_list: {errno}"
            )
        };
        Error::RdmaUnavailable { reason: why }
    })
}

fn gids_of(ctx: &DeviceContext, port: u8) -> Vec<GidInfo> {
    let Ok(table) = ctx.query_gid_table() else {
        return Vec::new();
    };
    table
        .iter()
        .filter(|e| e.port_num() == port as u32 && !e.gid().is_zero())
        .map(|e| GidInfo {
            index: e.gid_index(),
            gid: e.gid().to_string(),
            kind: gid_kind(e.gid_type()),
            ipv4: ipv4_mapped(&e.gid()),
        })
        .collect()
}

/// Why a port has no GID to use ([`pick_gid`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum NoGid {
    /// The configured GID index has no entry.
    #[error("GID index {index} is empty on this port")]
    Empty { index: u32 },
    /// A RoCE port without any GID.
    #[error("the GID table is empty (no IP address on the netdev?)")]
    NoTable,
}

/// Picks the GID to use on a port: the configured index, else a RoCE v2
/// IPv4-mapped GID, else any RoCE v2 GID that is not link-local, else index 0
/// (InfiniBand).
pub(crate) fn pick_gid(gids: &[GidInfo], want: Option<u32>, link: LinkLayer) -> std::result::Result<u32, NoGid> {
    if let Some(i) = want {
        return if gids.iter().any(|g| g.index == i) || link == LinkLayer::InfiniBand {
            Ok(i)
        } else {
            Err(NoGid::Empty { index: i })
        };
    }
    if link == LinkLayer::InfiniBand {
        return Ok(0);
    }
    if let Some(g) = gids.iter().find(|g| g.kind == "RoCE v2" && g.ipv4.is_some()) {
        return Ok(g.index);
    }
    if let Some(g) = gids.iter().find(|g| g.kind == "RoCE v2" && !g.gid.starts_with("fe80")) {
        return Ok(g.index);
    }
    gids.first().map(|g| g.index).ok_or(NoGid::NoTable)
}

fn link_name(l: LinkLayer) -> &'static str {
    match l {
        LinkLayer::InfiniBand => "InfiniBand",
        LinkLayer::Ethernet => "Ethernet",
        LinkLayer::Unspecified => "unspecified",
    }
}

/// Probes `ibv_reg_dmabuf_mr` as NCCL does: with fd -1, EOPNOTSUPP or
/// EPROTONOSUPPORT mean "unsupported", EBADF means the call reached a driver
/// that would take a real dmabuf.
pub(crate) fn probe_dmabuf(pd: &Arc<ProtectionDomain>) -> Dmabuf {
    // SAFETY: `pd` is a live protection domain; fd -1 is never a valid dmabuf,
    // so the call fails before it touches memory; a stray success is deregistered.
    let mr = unsafe { rdma_mummy_sys::ibv_reg_dmabuf_mr(pd.pd().as_ptr(), 0, 4096, 0, -1, 0) };
    let errno = std::io::Error::last_os_error();
    if !mr.is_null() {
        // SAFETY: `mr` was just returned by ibv_reg_dmabuf_mr and is released once.
        unsafe { rdma_mummy_sys::ibv_dereg_mr(mr) };
        return Dmabuf::Supported;
    }
    match errno.raw_os_error() {
        Some(libc::EBADF) => Dmabuf::Supported,
        Some(libc::EOPNOTSUPP) | Some(libc::EPROTONOSUPPORT) => Dmabuf::Unsupported(format!(
            "the driver answers {errno} (soft-RoCE/rxe and older kernels or libibverbs have no dmabuf)"
        )),
        _ => Dmabuf::Unsupported(format!("probe with fd -1 answered {errno}")),
    }
}

/// Lists every RDMA device with its ports, GIDs and dmabuf support.
pub fn list() -> Result<Vec<DeviceInfoSummary>> {
    let list = device_list()?;
    let mut out = Vec::new();
    for dev in list.iter() {
        let name = dev.name();
        let ctx = match dev.open() {
            Ok(c) => c,
            Err(e) => {
                out.push(DeviceInfoSummary {
                    name,
                    ports: Vec::new(),
                    dmabuf: Dmabuf::Unsupported(format!("cannot open the device: {e}")),
                    rate_limit: RateLimit::Unsupported(format!("cannot open the device: {e}")),
                    usable: false,
                });
                continue;
            }
        };
        let attr = ctx.query_device();
        let nports = attr.as_ref().map(|a| a.phys_port_cnt()).unwrap_or(1);
        let rate_limit = match &attr {
            Ok(a) => {
                let pp = a.attr.packet_pacing_caps;
                rate_limit_of(pp.qp_rate_limit_min, pp.qp_rate_limit_max, pp.supported_qpts)
            }
            Err(e) => RateLimit::Unsupported(format!("ibv_query_device_ex failed: {e}")),
        };
        let mut ports = Vec::new();
        for p in 1..=nports {
            let Ok(attr) = ctx.query_port(p) else { continue };
            let state = attr.port_state();
            ports.push(PortInfo {
                port: p,
                state: port_state_name(state).into(),
                active: state == PortState::Active,
                link_layer: link_name(attr.link_layer()),
                active_mtu: mtu_bytes(attr.active_mtu()),
                lid: attr.lid(),
                gids: gids_of(&ctx, p),
            });
        }
        let dmabuf = match ctx.alloc_pd() {
            Ok(pd) => probe_dmabuf(&pd),
            Err(e) => Dmabuf::Unsupported(format!("cannot allocate a protection domain: {e}")),
        };
        let usable = ports
            .iter()
            .any(|p| p.active && (p.link_layer == "InfiniBand" || !p.gids.is_empty()));
        out.push(DeviceInfoSummary {
            name,
            ports,
            dmabuf,
            rate_limit,
            usable,
        });
    }
    Ok(out)
}

/// The device, port and GID a transport runs on.
pub(crate) struct Selected {
    pub ctx: Arc<DeviceContext>,
    pub name: String,
    pub port: u8,
    pub gid_index: u32,
    pub gid: Gid,
    pub lid: u16,
    pub link: LinkLayer,
    pub active_mtu: Mtu,
    pub max_msg_sz: u64,
}

/// Opens the first device (or the named one) with an ACTIVE port and a usable GID.
pub(crate) fn select(choice: &DeviceChoice) -> Result<Selected> {
    let list = device_list()?;
    if list.is_empty() {
        return Err(Error::RdmaUnavailable {
            reason: "libibverbs found no RDMA device (no HCA; for soft-RoCE: \
                     `rdma link add rxe0 type rxe netdev eth0`)"
                .into(),
        });
    }
    let mut why = Vec::new();
    let mut seen = false;
    for dev in list.iter() {
        let name = dev.name();
        if choice.device.as_ref().is_some_and(|d| *d != name) {
            continue;
        }
        seen = true;
        let ctx = match dev.open() {
            Ok(c) => c,
            Err(e) => {
                why.push(format!("{name}: cannot open: {e}"));
                continue;
            }
        };
        let nports = ctx.query_device().map(|a| a.phys_port_cnt()).unwrap_or(1);
        for p in 1..=nports {
            if choice.port.is_some_and(|want| want != p) {
                continue;
            }
            match select_port(&ctx, &name, p, choice.gid_index) {
                Ok(s) => return Ok(s),
                Err(w) => why.push(w),
            }
        }
    }
    if !seen {
        let names: Vec<String> = list.iter().map(|d| d.name()).collect();
        return Err(Error::RdmaUnavailable {
            reason: format!(
                "no RDMA device named {:?} (present: {})",
                choice.device.as_deref().unwrap_or(""),
                names.join(", ")
            ),
        });
    }
    Err(Error::RdmaUnavailable {
        reason: format!("no usable port: {}", why.join("; ")),
    })
}

/// Port `p` of device `name` (opened as `ctx`) if it is ACTIVE and has a
/// usable GID (`gid_index`, or the best one); else why not.
fn select_port(
    ctx: &Arc<DeviceContext>,
    name: &str,
    p: u8,
    gid_index: Option<u32>,
) -> std::result::Result<Selected, String> {
    let attr = ctx
        .query_port(p)
        .map_err(|e| format!("{name} port {p}: query failed: {e}"))?;
    if attr.port_state() != PortState::Active {
        return Err(format!("{name} port {p}: {}", port_state_name(attr.port_state())));
    }
    let gids = gids_of(ctx, p);
    let gid_index = pick_gid(&gids, gid_index, attr.link_layer()).map_err(|e| format!("{name} port {p}: {e}"))?;
    let gid = ctx
        .query_gid(p, gid_index)
        .map_err(|e| format!("{name} port {p}: GID {gid_index}: {e}"))?;
    Ok(Selected {
        ctx: ctx.clone(),
        name: name.to_string(),
        port: p,
        gid_index,
        gid,
        lid: attr.lid(),
        link: attr.link_layer(),
        active_mtu: attr.active_mtu(),
        // RC messages may be up to 2^31 bytes; one write is capped at 1 GiB.
        max_msg_sz: 1 << 30,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(index: u32, gid: &str, kind: &'static str, ipv4: Option<Ipv4Addr>) -> GidInfo {
        GidInfo {
            index,
            gid: gid.into(),
            kind,
            ipv4,
        }
    }

    #[test]
    fn packet_pacing_caps_read() {
        assert!(matches!(rate_limit_of(0, 0, 0), RateLimit::Unsupported(w) if w.contains("rxe")));
        // mlx5 reports pacing on RAW_PACKET (bit 8) QPs.
        assert_eq!(
            rate_limit_of(1, 100_000_000, 1 << 8),
            RateLimit::Supported {
                min_kbps: 1,
                max_kbps: 100_000_000,
                qp_types: vec!["RAW_PACKET"]
            }
        );
    }

    #[test]
    fn gid_choice_prefers_roce_v2_ipv4() {
        let table = vec![
            g(0, "fe80:0000:0000:0000:0000:00ff:fe00:0001", "RoCE v1", None),
            g(1, "fe80:0000:0000:0000:0000:00ff:fe00:0001", "RoCE v2", None),
            g(
                2,
                "0000:0000:0000:0000:0000:ffff:c000:0201",
                "RoCE v1",
                Some(Ipv4Addr::new(192, 0, 2, 1)),
            ),
            g(
                3,
                "0000:0000:0000:0000:0000:ffff:c000:0201",
                "RoCE v2",
                Some(Ipv4Addr::new(192, 0, 2, 1)),
            ),
        ];
        assert_eq!(pick_gid(&table, None, LinkLayer::Ethernet), Ok(3));
        assert_eq!(pick_gid(&table, Some(2), LinkLayer::Ethernet), Ok(2));
        let e = pick_gid(&table, Some(9), LinkLayer::Ethernet).unwrap_err();
        assert_eq!(e, NoGid::Empty { index: 9 });
        assert!(e.to_string().contains("empty"), "{e}");
        assert_eq!(
            pick_gid(&table[..2], None, LinkLayer::Ethernet),
            Ok(0),
            "link-local only: first entry"
        );
        assert_eq!(pick_gid(&[], None, LinkLayer::Ethernet), Err(NoGid::NoTable));
        assert_eq!(pick_gid(&[], None, LinkLayer::InfiniBand), Ok(0));
    }

    #[test]
    fn ipv4_mapped_gids() {
        let mut raw = [0u8; 16];
        raw[10] = 0xff;
        raw[11] = 0xff;
        raw[12..].copy_from_slice(&[10, 1, 2, 3]);
        assert_eq!(ipv4_mapped(&Gid { raw }), Some(Ipv4Addr::new(10, 1, 2, 3)));
        raw[0] = 0xfe;
        assert_eq!(ipv4_mapped(&Gid { raw }), None);
    }

    #[test]
    fn env_overrides_are_checked() {
        // Parsing only: no device is touched.
        let c = DeviceChoice {
            device: Some("x".into()),
            ..Default::default()
        };
        assert_eq!(c.device.as_deref(), Some("x"));
        let bad = DeviceChoice::default();
        std::env::set_var("TIDEWIRE_RDMA_PORT", "zero");
        let e = bad.from_env().unwrap_err();
        std::env::remove_var("TIDEWIRE_RDMA_PORT");
        assert!(e.to_string().contains("TIDEWIRE_RDMA_PORT"), "{e}");
    }
}
