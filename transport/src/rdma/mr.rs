//! Memory registration: host regions (`ibv_reg_mr`), device memory by
//! dmabuf (`ibv_reg_dmabuf_mr`), and the local keys work requests carry.

use std::sync::Arc;

use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::AccessFlags;
use tracing::warn;

use crate::error::{Error, Result};
use crate::memory::{Access, PinnedBuffer, Region, RemoteRegion, Slice};

use super::device::{self, Dmabuf};
use super::error::{io_of, verbs};
use super::state::Registered;
use super::RdmaTransport;

/// A device-memory region registered by dmabuf ([`RdmaTransport::reg_dmabuf`]).
/// The host cannot read it; peers write into it through [`DmabufRegion::remote`].
#[derive(Debug)]
pub struct DmabufRegion {
    mr: Arc<MemoryRegion>,
    iova: u64,
    len: u64,
}

impl DmabufRegion {
    /// The descriptor peers write with (address = the iova given at registration).
    pub fn remote(&self) -> RemoteRegion {
        RemoteRegion {
            addr: self.iova,
            len: self.len,
            rkey: self.mr.rkey(),
            generation: 0,
        }
    }
    /// The local key, for work requests that read from it.
    pub fn lkey(&self) -> u32 {
        self.mr.lkey()
    }
}

impl RdmaTransport {
    /// Registers host memory (`ibv_reg_mr`); remote-writable regions are announced to every peer.
    pub(super) fn register_host(&mut self, buf: PinnedBuffer, access: Access) -> Result<Region> {
        let mut flags = AccessFlags::LocalWrite;
        if access.remote_write {
            flags = flags | AccessFlags::RemoteWrite | AccessFlags::RemoteRead;
        }
        let (ptr, len) = (buf.as_ptr() as usize, buf.len());
        // SAFETY: the buffer moves into the Region kept next to its MR in `self.regions`;
        // the MR is deregistered first, and in-flight guards keep the memory alive.
        let mr = unsafe { self.pd.reg_mr(ptr, len, flags) };
        let mr = mr.map_err(|e| verbs("ibv_reg_mr", &self.dev.name, io_of(e)))?;
        self.generation = self.generation.wrapping_add(1).max(1);
        // The key names the region locally and, for remote-writable regions, is the
        // rkey peers use. Local-only MRs may all have rkey 0 (rxe), so they go by lkey.
        let key = if access.remote_write { mr.rkey() } else { mr.lkey() };
        let r = Region::new(buf, key, self.generation, access, None);
        if let Some(old) = self.regions.insert(r.key(), Registered { mr, region: r.clone() }) {
            warn!(key = old.region.key(), "device reused an rkey still in the table");
        }
        if access.remote_write {
            self.broadcast_regions(r.remote(), false);
        }
        Ok(r)
    }

    /// Deregisters a host region (refused while operations use it) and revokes it at the peers.
    pub(super) fn deregister_host(&mut self, region: &Region) -> Result<()> {
        let known = self.regions.get(&region.key()).is_some_and(|r| r.region.same(region));
        crate::memory::check_deregister(known, region)?;
        // Writes that already landed are delivered while their notices still
        // name a registered region (a notice for an unknown one fails its connection).
        let _ = self.poll_cq();
        let reg = self.regions.remove(&region.key()).expect("checked");
        drop(reg.mr);
        region.0.registered.store(false, std::sync::atomic::Ordering::Release);
        if region.access().remote_write {
            self.broadcast_regions(region.remote(), true);
        }
        Ok(())
    }

    /// Whether this device registers dmabuf memory (probed once, NCCL's way).
    pub fn dmabuf_support(&mut self) -> Dmabuf {
        if self.dmabuf.is_none() {
            self.dmabuf = Some(device::probe_dmabuf(&self.pd));
        }
        self.dmabuf.clone().expect("set above")
    }

    /// Registers device memory exported as a dmabuf (`ibv_reg_dmabuf_mr`), for
    /// GPUDirect RDMA. Arguments are checked first; a device without dmabuf
    /// support answers [`Error::DmabufUnsupported`], and the caller stages
    /// through pinned host memory instead.
    pub fn reg_dmabuf(&mut self, fd: i32, offset: u64, len: usize, iova: u64) -> Result<DmabufRegion> {
        validate_dmabuf_args(fd, offset, len, iova)?;
        if let Dmabuf::Unsupported(reason) = self.dmabuf_support() {
            return Err(Error::DmabufUnsupported {
                device: self.dev.name.clone(),
                reason,
            });
        }
        // SAFETY: the arguments were validated; the caller's fd names a dmabuf whose
        // range the exporter keeps alive while the returned region (which owns the MR)
        // lives; the device reads and writes it only through work requests.
        let mr = unsafe {
            self.pd.reg_dmabuf_mr(
                offset,
                len,
                iova,
                fd,
                AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead,
            )
        }
        .map_err(|e| verbs("ibv_reg_dmabuf_mr", &self.dev.name, io_of(e)))?;
        // Peers may write into it with notices: remember it (weakly) so they can be checked.
        self.dmabuf_targets.retain(|_, (_, mr)| mr.strong_count() > 0);
        self.dmabuf_targets
            .insert(mr.rkey(), (len as u64, std::sync::Arc::downgrade(&mr)));
        Ok(DmabufRegion {
            mr,
            iova,
            len: len as u64,
        })
    }

    pub(super) fn lkey_of(&self, s: &Slice, op: &'static str) -> Result<u32> {
        let r = s.region();
        match self.regions.get(&r.key()) {
            Some(reg) if reg.region.same(r) && r.is_registered() => Ok(reg.mr.lkey()),
            _ => Err(Error::UnknownRegion {
                op,
                region: r.key(),
                generation: r.generation(),
            }),
        }
    }
}

/// Checks `reg_dmabuf`'s arguments before any verbs call.
pub fn validate_dmabuf_args(fd: i32, offset: u64, len: usize, iova: u64) -> Result<()> {
    let bad = |reason: String| {
        Err(Error::InvalidArgument {
            op: "reg_dmabuf",
            reason,
        })
    };
    if fd < 0 {
        return bad(format!("fd {fd} is not a file descriptor"));
    }
    if len == 0 {
        return bad("length 0: nothing to register".into());
    }
    if offset.checked_add(len as u64).is_none() || iova.checked_add(len as u64).is_none() {
        return bad(format!("offset {offset} / iova {iova:#x} + length {len} overflows"));
    }
    let page = crate::memory::page_size() as u64;
    if offset % page != iova % page {
        return bad(format!(
            "offset {offset:#x} and iova {iova:#x} must agree modulo the page size ({page})"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dmabuf_arguments_are_validated_before_any_verbs_call() {
        assert!(validate_dmabuf_args(-1, 0, 4096, 0)
            .unwrap_err()
            .to_string()
            .contains("fd -1"));
        assert!(validate_dmabuf_args(3, 0, 0, 0)
            .unwrap_err()
            .to_string()
            .contains("length 0"));
        assert!(validate_dmabuf_args(3, u64::MAX, 4096, 0)
            .unwrap_err()
            .to_string()
            .contains("overflows"));
        assert!(validate_dmabuf_args(3, 4096, 4096, 100)
            .unwrap_err()
            .to_string()
            .contains("modulo the page size"));
        assert!(validate_dmabuf_args(3, 8192, 1 << 20, 0x7000_0000_0000).is_ok());
    }
}
