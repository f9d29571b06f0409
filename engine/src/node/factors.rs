//! Sufficient factors on their way in: reassembly of each peer's factor
//! block from its fragments, and the store of every worker's block per
//! (layer, iteration) until the reconstruction takes them.
//!
//! Bounds: one open block per peer; blocks are kept only for iterations not
//! yet reconstructed (at most `s + 1` per layer under SSP(s)).

use super::types::{Blob, Payload};
use crate::fxhash::FxHashMap as HashMap;

#[derive(Debug)]
struct Stream {
    layer: u32,
    iter: u64,
    total: usize,
    got: usize,
    /// `None` once a fragment came as `Payload::Opaque` (simulation).
    bytes: Option<Vec<u8>>,
}

/// See the module docs.
#[derive(Debug)]
pub(crate) struct Inbox {
    open: Vec<Option<Stream>>,
    store: HashMap<(u32, u64), Vec<Option<Blob>>>,
    p1: usize,
    held: usize,
    max_held: usize,
}

impl Inbox {
    pub(crate) fn new(world: usize, p1: usize) -> Self {
        Inbox {
            open: (0..world).map(|_| None).collect(),
            store: HashMap::default(),
            p1,
            held: 0,
            max_held: 0,
        }
    }

    /// A block of `total` bytes from `peer` starts.
    pub(crate) fn begin(&mut self, peer: u32, layer: u32, iter: u64, total: usize) -> Result<(), String> {
        let slot = &mut self.open[peer as usize];
        if let Some(s) = slot {
            return Err(format!(
                "a factor block for layer {layer} began while the one for layer {} iteration {} was incomplete",
                s.layer, s.iter
            ));
        }
        *slot = Some(Stream {
            layer,
            iter,
            total,
            got: 0,
            bytes: Some(Vec::with_capacity(total)),
        });
        Ok(())
    }

    /// A fragment from `peer`. Returns the block when it is complete.
    pub(crate) fn data(&mut self, peer: u32, data: Payload) -> Result<Option<(u32, u64, Blob)>, String> {
        let slot = &mut self.open[peer as usize];
        let Some(s) = slot.as_mut() else {
            return Err("factor data without a factor block".into());
        };
        let n = data.len();
        if n == 0 || s.got + n > s.total {
            return Err(format!(
                "a factor fragment of {n} bytes at {} of a {}-byte block",
                s.got, s.total
            ));
        }
        s.got += n;
        match data {
            Payload::Bytes(b) => {
                if let Some(v) = s.bytes.as_mut() {
                    v.extend_from_slice(&b);
                }
            }
            Payload::Opaque(_) => s.bytes = None,
        }
        if s.got < s.total {
            return Ok(None);
        }
        let s = slot.take().expect("open");
        let blob = match s.bytes {
            Some(b) => Blob::Bytes(b),
            None => Blob::Opaque(s.total),
        };
        Ok(Some((s.layer, s.iter, blob)))
    }

    /// Stores worker index `wi`'s block.
    pub(crate) fn put(&mut self, layer: u32, iter: u64, wi: usize, blob: Blob) -> Result<(), String> {
        let e = self.store.entry((layer, iter)).or_insert_with(|| vec![None; self.p1]);
        if e[wi].is_some() {
            return Err(format!("a second factor block for layer {layer} iteration {iter}"));
        }
        e[wi] = Some(blob);
        self.held += 1;
        self.max_held = self.max_held.max(self.held);
        Ok(())
    }

    /// Every worker's block, in worker order, once all are here.
    pub(crate) fn take(&mut self, layer: u32, iter: u64) -> Option<Vec<Blob>> {
        let e = self.store.get(&(layer, iter))?;
        if e.iter().any(Option::is_none) {
            return None;
        }
        let e = self.store.remove(&(layer, iter)).expect("present");
        self.held -= e.len();
        Some(e.into_iter().map(|b| b.expect("checked")).collect())
    }

    /// Blocks held now (for the memory bound).
    #[cfg(test)]
    pub(crate) fn held(&self) -> usize {
        self.held
    }
    /// Most blocks held at once.
    pub(crate) fn max_held(&self) -> usize {
        self.max_held
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fragments_reassemble_in_order_and_misuse_is_refused() {
        let mut ib = Inbox::new(3, 2);
        assert!(ib.data(1, Payload::Bytes(vec![1])).is_err());
        ib.begin(1, 4, 0, 5).unwrap();
        assert!(ib.begin(1, 4, 1, 5).is_err(), "one open block per peer");
        assert_eq!(ib.data(1, Payload::Bytes(vec![1, 2, 3])).unwrap(), None);
        assert!(ib.data(1, Payload::Bytes(vec![0; 3])).is_err(), "overrun");
        let (l, i, b) = ib.data(1, Payload::Bytes(vec![4, 5])).unwrap().unwrap();
        assert_eq!((l, i, b), (4, 0, Blob::Bytes(vec![1, 2, 3, 4, 5])));
        ib.put(4, 0, 1, Blob::Bytes(vec![9])).unwrap();
        assert!(ib.take(4, 0).is_none());
        assert!(ib.put(4, 0, 1, Blob::Opaque(1)).is_err());
        ib.put(4, 0, 0, Blob::Opaque(5)).unwrap();
        assert_eq!(ib.take(4, 0).unwrap().len(), 2);
        assert_eq!(ib.held(), 0);
    }
}
