//! Who holds a region's bytes: a [`Lease`] (exclusive local access to a
//! range, taken with [`Region::lease`]) and an in-flight guard (one operation
//! using the region), with the check a backend makes before deregistering.

use std::fmt;

use std::sync::atomic::Ordering;

use super::Region;
use crate::error::{Error, Result};

/// Exclusive local access to a byte range of a [`Region`]; see [`Region::lease`].
/// No other lease and no copy touches the range while it lives (device and
/// kernel I/O excepted: the protocol must keep the range quiet). The range is
/// released when the lease drops.
pub struct Lease {
    region: Region,
    offset: usize,
    len: usize,
    id: u64,
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("region", &format_args!("{:#x}", self.region.0.key))
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

impl Lease {
    /// The region.
    pub fn region(&self) -> &Region {
        &self.region
    }
    /// Offset of the range in the region, bytes.
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// Length, bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The leased bytes.
    pub fn as_bytes(&self) -> &[u8] {
        // Remote I/O into the range is the protocol's business (see `Region::lease`).
        // SAFETY: bounds-checked at lease time; the mapping lives as long as `self.region`;
        // no other lease overlaps, and the copies refuse leased bytes, so no Rust code
        // writes the range while this borrow of the lease lives.
        unsafe { std::slice::from_raw_parts(self.region.as_ptr().add(self.offset), self.len) }
    }
    /// The leased bytes, writable.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_bytes`; `&mut self` makes this the only borrow of the lease.
        unsafe { std::slice::from_raw_parts_mut(self.region.as_ptr().add(self.offset), self.len) }
    }
    fn f32_ok(&self) -> Result<usize> {
        if self.offset % 4 != 0 || self.len % 4 != 0 {
            return Err(Error::InvalidArgument {
                op: "Lease::as_f32",
                reason: format!("range {}+{} is not 4-byte aligned", self.offset, self.len),
            });
        }
        Ok(self.len / 4)
    }
    /// The leased range as f32 (the offset and length must be multiples of 4).
    pub fn as_f32(&self) -> Result<&[f32]> {
        let n = self.f32_ok()?;
        // SAFETY: as in `as_bytes`; the region base is page aligned and the
        // offset a multiple of 4, so the pointer is aligned for f32, and any
        // bit pattern is a valid f32.
        Ok(unsafe { std::slice::from_raw_parts(self.region.as_ptr().add(self.offset) as *const f32, n) })
    }
    /// The leased range as mutable f32.
    pub fn as_f32_mut(&mut self) -> Result<&mut [f32]> {
        let n = self.f32_ok()?;
        // SAFETY: as in `as_f32`; `&mut self` makes this the only borrow of the lease.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.region.as_ptr().add(self.offset) as *mut f32, n) })
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut leases = self.region.0.leases.lock().unwrap_or_else(|p| p.into_inner());
        leases.retain(|l| l.2 != self.id);
    }
}

impl Region {
    /// Exclusive local access to `[offset, offset+len)`, for code that computes
    /// on registered memory in place (filling a gradient, summing a landing slot,
    /// applying an update).
    ///
    /// Leases never overlap, and the copies ([`Region::read_at`],
    /// [`Region::write_at`], [`Region::fill`], [`Region::read_f32_relaxed`])
    /// refuse leased bytes: a second lease or a copy touching any byte of a
    /// leased range fails with [`Error::RegionBusy`] until the lease is dropped,
    /// so safe code cannot alias the memory, on any thread. What a lease cannot
    /// stop is I/O that the protocol above controls: a one-sided write from a
    /// peer into the range, or a send or write posted from it, runs
    /// concurrently and can tear the values it touches (and the slice the
    /// lease hands out would then change underneath it). Lease a range only
    /// while the protocol guarantees it is quiet (after the write's completion
    /// event, before the next post); to read bytes that may still be landing,
    /// use [`Region::read_f32_relaxed`] or [`Region::read_at`] instead.
    pub fn lease(&self, offset: usize, len: usize) -> Result<Lease> {
        let mut leases = self.quiet_range(offset, len, "Region::lease")?;
        let id = self.0.next_lease.fetch_add(1, Ordering::Relaxed) as u64;
        leases.push((offset, offset + len, id));
        Ok(Lease {
            region: self.clone(),
            offset,
            len,
            id,
        })
    }

    /// [`Region::lease`] of `len` f32 elements starting at element `offset`.
    pub fn lease_f32(&self, offset: usize, len: usize) -> Result<Lease> {
        let (o, l) = match (offset.checked_mul(4), len.checked_mul(4)) {
            (Some(o), Some(l)) => (o, l),
            _ => {
                return Err(Error::InvalidArgument {
                    op: "Region::lease_f32",
                    reason: "element range overflows".into(),
                })
            }
        };
        self.lease(o, l)
    }
}

/// Whether a backend may deregister `region`: it must be the backend's own
/// (`known`) and have no operation in flight. Shared by the backends.
pub(crate) fn check_deregister(known: bool, region: &Region) -> Result<()> {
    if !known {
        return Err(Error::UnknownRegion {
            op: "deregister",
            region: region.key(),
            generation: region.generation(),
        });
    }
    match region.in_flight() {
        0 => Ok(()),
        in_flight => Err(Error::RegionBusy {
            op: "deregister",
            region: region.key(),
            in_flight,
        }),
    }
}

/// Guards one in-flight use of a region; dropping it releases the use.
#[derive(Debug)]
pub(crate) struct InFlight(pub(crate) Region);

impl InFlight {
    pub(crate) fn new(r: &Region) -> Self {
        r.0.in_flight.fetch_add(1, Ordering::AcqRel);
        InFlight(r.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0 .0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::{Access, PinOptions, PinnedBuffer};

    #[test]
    fn leases_are_exclusive_and_typed() {
        let r = Region::new(
            PinnedBuffer::with_options(
                4096,
                PinOptions {
                    lock: false,
                    ..Default::default()
                },
            )
            .unwrap(),
            1,
            1,
            Access::LOCAL,
            None,
        );
        let mut a = r.lease_f32(0, 4).unwrap();
        a.as_f32_mut().unwrap().copy_from_slice(&[1.0, 2.0, 3.0, 4.0]);
        assert!(
            matches!(r.lease(12, 8), Err(Error::RegionBusy { .. })),
            "overlap refused"
        );
        let b = r.lease_f32(4, 4).unwrap();
        assert_eq!(b.as_f32().unwrap(), &[0.0; 4]);
        drop(a);
        let a = r.lease_f32(0, 4).unwrap();
        assert_eq!(a.as_f32().unwrap(), &[1.0, 2.0, 3.0, 4.0]);
        assert!(r.lease(33, 4).unwrap().as_f32().is_err(), "misaligned f32 view refused");
        assert!(matches!(r.lease(4090, 8), Err(Error::OutOfBounds { .. })));
        drop(b);
    }
}
