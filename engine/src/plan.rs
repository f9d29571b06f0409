//! Scheme switches: the iterations at which a fully connected layer stops
//! syncing by one scheme and starts on the other (PS ↔ SFB), and the
//! arithmetic every rank derives from them.
//!
//! A switch takes effect at an iteration boundary and is the same on every
//! rank (the schedule is part of the book, so part of its agreed hash).
//! What changes hands at a switch (see the cores):
//! - **PS → SFB at `t`**: every worker holds the parameters after the
//!   servers' broadcast of `t − 1`, and rebuilds and applies from `t` on.
//! - **SFB → PS at `t`**: worker index 0 writes its parameters (after its
//!   reconstruction of `t − 1`) into each chunk's place in the servers'
//!   shards, as it seeds them at the start ([`Plan::reseeds_at`]); a server
//!   applies `t` only once that write landed.
//!
//! Servers count the rounds they take part in (server-held iterations) and
//! name each by its iteration ([`Plan::server_iter`]); workers wait for one
//! broadcast per such round ([`Plan::server_rounds`]).
//!
//! An apply op that keeps state beside the parameters (SGD's momentum)
//! moves it the same ways, by messages ([`crate::wire::Msg::MomentumBegin`]):
//! worker 0's momentum to the servers beside its write-back, and each
//! server's momentum of a chunk to every worker after its last PS round
//! ([`Plan::leaves_ps_at`]); the servers' first apply and the workers'
//! first reconstruction wait for it. The layers that may move
//! ([`Plan::movable`]) keep their momentum in the `Moments` region for it.

/// How a layer synchronizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Scheme {
    /// Push gradients to the sharded parameter server, receive parameters back.
    Ps,
    /// Broadcast sufficient factors (U, V) to peer workers.
    Sfb,
    /// Project Adam's strategy, as Poseidon §3.2 describes it (the baseline
    /// its traffic figure compares against): send the sufficient factors to
    /// the one server that holds the whole layer, which rebuilds the
    /// gradient Σ_p U_pᵀ·V_p, applies it and broadcasts the full matrix.
    /// Workers move little; the layer's server moves P1 full matrices.
    Adam,
}

impl Scheme {
    /// Whether a layer with this scheme is handed in as its sufficient
    /// factors (U, V) rather than its gradient.
    pub fn takes_factors(self) -> bool {
        let f = matches!(self, Scheme::Sfb | Scheme::Adam);
        // Only the PS takes a gradient.
        debug_assert_eq!(f, self != Scheme::Ps);
        f
    }
    /// Whether the layer's parameters live on the servers (PS and Adam: the
    /// servers apply and broadcast them), rather than on every worker (SFB).
    pub fn server_held(self) -> bool {
        let held = self != Scheme::Sfb;
        // Adam's server holds its layer too, and takes factors.
        debug_assert!(held || self.takes_factors());
        held
    }
}

/// One switch: `layer` syncs by `scheme` from iteration `iter` on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Switch {
    /// The layer (its forward index).
    pub layer: u32,
    /// The first iteration under the new scheme (at least 1).
    pub iter: u64,
    /// The scheme from then on: PS or SFB.
    pub scheme: Scheme,
}

impl std::fmt::Display for Switch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self.scheme {
            Scheme::Ps => "ps",
            Scheme::Sfb => "sfb",
            Scheme::Adam => "adam",
        };
        write!(f, "layer {} to {s} at iteration {}", self.layer, self.iter)
    }
}

/// Why a switch was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PlanError {
    /// No such layer.
    #[error("switch {0}: no such layer")]
    UnknownLayer(Switch),
    /// A switch at iteration 0 is the start-up choice, not a switch.
    #[error("switch {0}: a switch takes effect at iteration 1 or later")]
    AtStart(Switch),
    /// Switches of a layer come in iteration order.
    #[error("switch {0}: not after the layer's previous switch (iteration {1})")]
    OutOfOrder(Switch, u64),
    /// The layer already syncs by that scheme then.
    #[error("switch {0}: the layer already syncs by that scheme")]
    NoChange(Switch),
    /// Only PS and SFB trade places.
    #[error("switch {0}: only ps and sfb switch, and only from one to the other")]
    NotPsSfb(Switch),
    /// A decision for another point than the next, or with bits past the contested layers.
    #[error(
        "a decision for iteration {at}, where the next decision point is {next:?} (or bits past the contested layers)"
    )]
    NotThePoint { at: u64, next: Option<u64> },
}

/// Per layer, its start-up scheme and its switches (see the module docs).
///
/// **Adaptive** ([`Plan::adaptive`]): every `every` iterations, at the
/// decision points `every`, `2·every`, ..., worker index 0 decides the
/// scheme of each contested layer (every dense FC layer) for the next
/// `every` iterations and tells every rank ([`Plan::decide`]). Iterations
/// from the next point on are undecided ([`Plan::is_decided`]) until then:
/// what the plan says of them is provisional (the last decision, carried on).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    first: Vec<Scheme>,
    /// Per layer: (first iteration, scheme), ascending, each a change.
    switches: Vec<Vec<(u64, Scheme)>>,
    /// Iterations below this are decided (u64::MAX: all of them).
    decided: u64,
    /// The decision period (0: no decisions).
    every: u64,
    /// The layers decided at each point, in layer order (bit i of a decision is the i-th's).
    contested: Vec<u32>,
}

impl Plan {
    /// No switches: every layer keeps `first[layer]` for the whole run.
    pub fn new(first: Vec<Scheme>) -> Self {
        let n = first.len();
        let p = Plan {
            first,
            switches: vec![Vec::new(); n],
            decided: u64::MAX,
            every: 0,
            contested: Vec::new(),
        };
        debug_assert!(!p.has_switches() && p.next_point().is_none());
        p
    }

    /// This plan deciding `contested`'s schemes every `every` iterations
    /// (see the type's docs): at most 64 layers, a period of at least 1.
    pub(crate) fn adaptive(&mut self, every: u64, contested: Vec<u32>) {
        debug_assert!(every >= 1 && contested.len() <= 64 && !self.has_switches());
        debug_assert!(contested.iter().all(|&l| (l as usize) < self.first.len()));
        self.every = every;
        self.decided = every;
        self.contested = contested;
    }

    /// No more decisions: every iteration is final as the plan says now.
    pub(crate) fn settle_all(&mut self) {
        self.every = 0;
        self.decided = u64::MAX;
        self.contested.clear();
        debug_assert!(self.next_point().is_none() && self.is_decided(u64::MAX - 1));
    }

    /// Whether iteration `iter`'s schemes are final.
    pub fn is_decided(&self, iter: u64) -> bool {
        // Without decisions, every iteration is decided.
        debug_assert!(self.every > 0 || self.decided == u64::MAX);
        iter < self.decided
    }

    /// Whether `layer`'s scheme in iteration `iter` is final: decided, or a
    /// layer no decision covers.
    pub fn settled(&self, layer: u32, iter: u64) -> bool {
        debug_assert!((layer as usize) < self.first.len(), "layer {layer}");
        self.is_decided(iter) || !self.contested.contains(&layer)
    }

    /// The next decision point, when the plan is adaptive.
    pub fn next_point(&self) -> Option<u64> {
        // Points are the multiples of the period, from the first.
        debug_assert!(self.every == 0 || (self.decided >= self.every && self.decided % self.every == 0));
        (self.every > 0).then_some(self.decided)
    }

    /// The decision period (0: not adaptive).
    pub fn every(&self) -> u64 {
        debug_assert!(self.every > 0 || self.contested.is_empty());
        self.every
    }

    /// The layers each decision covers, in the order of its bits.
    pub fn contested(&self) -> &[u32] {
        // In layer order: bit i of a decision is the i-th.
        debug_assert!(self.contested.windows(2).all(|w| w[0] < w[1]));
        &self.contested
    }

    /// The decision for the point `at` (the next one): bit i of `sfb` set
    /// puts [`Plan::contested`]'s i-th layer on SFB from `at`, clear on the
    /// PS. Returns the switches it made (layers whose scheme changes).
    pub fn decide(&mut self, at: u64, sfb: u64) -> Result<Vec<Switch>, PlanError> {
        if self.next_point() != Some(at) || (self.contested.len() < 64 && sfb >> self.contested.len() != 0) {
            return Err(PlanError::NotThePoint {
                at,
                next: self.next_point(),
            });
        }
        // On a copy: a decision is taken whole or not at all.
        let mut next = self.clone();
        let mut made = Vec::new();
        for (i, &layer) in self.contested.iter().enumerate() {
            let scheme = if sfb >> i & 1 == 1 { Scheme::Sfb } else { Scheme::Ps };
            if self.scheme(layer, at) != scheme {
                let sw = Switch {
                    layer,
                    iter: at,
                    scheme,
                };
                next.add(sw)?;
                made.push(sw);
            }
        }
        *self = next;
        self.decided = at.saturating_add(self.every);
        debug_assert!(self.is_decided(at) && !self.is_decided(self.decided));
        // Every switch a decision makes takes effect at its point.
        debug_assert!(made
            .iter()
            .all(|s| s.iter == at && self.scheme(s.layer, at) == s.scheme));
        Ok(made)
    }

    /// The decision that keeps every contested layer as it is at `iter`
    /// (the bits [`Plan::decide`] takes).
    pub fn current_bits(&self, iter: u64) -> u64 {
        let bits = self
            .contested
            .iter()
            .enumerate()
            .filter(|&(_, &l)| self.scheme(l, iter) == Scheme::Sfb)
            .fold(0, |b, (i, _)| b | 1 << i);
        debug_assert!(self.contested.len() >= 64 || bits >> self.contested.len() == 0);
        bits
    }

    /// The start-up schemes chosen again (the switches must still be
    /// changes from them: call before [`Plan::add`]).
    pub(crate) fn set_first(&mut self, first: Vec<Scheme>) {
        debug_assert!(!self.has_switches(), "the start-up choice is made before any switch");
        debug_assert_eq!(first.len(), self.first.len());
        self.first = first;
    }

    /// Adds a switch after the layer's last one.
    pub fn add(&mut self, sw: Switch) -> Result<(), PlanError> {
        let l = sw.layer as usize;
        if l >= self.first.len() {
            return Err(PlanError::UnknownLayer(sw));
        }
        if sw.iter == 0 {
            return Err(PlanError::AtStart(sw));
        }
        if let Some(&(last, _)) = self.switches[l].last() {
            if sw.iter <= last {
                return Err(PlanError::OutOfOrder(sw, last));
            }
        }
        let now = self.scheme(sw.layer, sw.iter);
        if now == sw.scheme {
            return Err(PlanError::NoChange(sw));
        }
        if !matches!((now, sw.scheme), (Scheme::Ps, Scheme::Sfb) | (Scheme::Sfb, Scheme::Ps)) {
            return Err(PlanError::NotPsSfb(sw));
        }
        self.switches[l].push((sw.iter, sw.scheme));
        debug_assert_eq!(self.scheme(sw.layer, sw.iter), sw.scheme);
        Ok(())
    }

    /// Whether any layer switches.
    pub fn has_switches(&self) -> bool {
        debug_assert_eq!(self.switches.len(), self.first.len());
        self.switches.iter().any(|s| !s.is_empty())
    }

    /// Every switch, by layer then iteration.
    pub fn switches(&self) -> impl Iterator<Item = Switch> + '_ {
        self.switches.iter().enumerate().flat_map(|(l, s)| {
            s.iter().map(move |&(iter, scheme)| Switch {
                layer: l as u32,
                iter,
                scheme,
            })
        })
    }

    /// The scheme `layer` syncs by in iteration `iter`.
    pub fn scheme(&self, layer: u32, iter: u64) -> Scheme {
        let l = layer as usize;
        let sw = &self.switches[l];
        debug_assert!(
            sw.windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 != w[1].1),
            "layer {layer}: {sw:?}"
        );
        // The last switch at or before `iter` (few per layer: a scan).
        match sw.iter().rev().find(|&&(from, _)| from <= iter) {
            Some(&(_, s)) => s,
            None => self.first[l],
        }
    }

    /// Iterations in `[0, n)` in which the servers hold `layer` (PS or
    /// Adam): the rounds its chunks are applied and broadcast.
    pub fn server_rounds(&self, layer: u32, n: u64) -> u64 {
        let l = layer as usize;
        let mut count = 0;
        let (mut at, mut s) = (0u64, self.first[l]);
        for &(from, next) in &self.switches[l] {
            if from >= n {
                break;
            }
            if s.server_held() {
                count += from - at;
            }
            (at, s) = (from, next);
        }
        if s.server_held() && n > at {
            count += n - at;
        }
        // Never more rounds than iterations.
        debug_assert!(count <= n);
        count
    }

    /// The iteration of `layer`'s server round `k` (0-based): the `k`-th
    /// server-held iteration. Past the last switch rounds run on unbounded.
    pub fn server_iter(&self, layer: u32, k: u64) -> u64 {
        let t = self.round_iter(layer, k);
        // A plan that ends under SFB has no more server rounds: none is asked for.
        debug_assert!(t.is_some(), "layer {layer} has no server round {k}");
        t.unwrap_or(u64::MAX)
    }

    /// The iteration of `layer`'s server round `k`, if it has one (none
    /// past the last round of a plan that ends under SFB).
    pub fn round_iter(&self, layer: u32, k: u64) -> Option<u64> {
        let l = layer as usize;
        let (mut at, mut s, mut left) = (0u64, self.first[l], k);
        for &(from, next) in &self.switches[l] {
            if s.server_held() {
                let n = from - at;
                if left < n {
                    return Some(at + left);
                }
                left -= n;
            }
            (at, s) = (from, next);
        }
        let t = s.server_held().then_some(at + left);
        // A round is a server-held iteration.
        debug_assert!(t.map_or(true, |t| self.scheme(layer, t).server_held()));
        t
    }

    /// The first iteration at or after `from` that `layer` syncs by SFB.
    pub fn next_sfb(&self, layer: u32, from: u64) -> Option<u64> {
        if self.scheme(layer, from) == Scheme::Sfb {
            return Some(from);
        }
        let t = self.switches[layer as usize]
            .iter()
            .find(|&&(at, s)| at > from && s == Scheme::Sfb)
            .map(|&(at, _)| at);
        debug_assert!(t.map_or(true, |t| t > from && self.scheme(layer, t) == Scheme::Sfb));
        t
    }

    /// Whether `layer` leaves the servers at `iter` (PS at `iter − 1`, SFB
    /// at `iter`): every worker needs the servers' momentum of it first.
    pub fn leaves_ps_at(&self, layer: u32, iter: u64) -> bool {
        self.switches_at(layer, iter, Scheme::Ps, Scheme::Sfb)
    }

    /// Whether `layer` syncs by `from` at `iter − 1` and by `to` at `iter`.
    fn switches_at(&self, layer: u32, iter: u64, from: Scheme, to: Scheme) -> bool {
        debug_assert_ne!(from, to, "a switch changes the scheme");
        let r = iter > 0 && self.scheme(layer, iter - 1) == from && self.scheme(layer, iter) == to;
        // Only a switch changes a layer's scheme: never at the start.
        debug_assert!(
            !r || self.switches[layer as usize]
                .iter()
                .any(|&(at, s)| at == iter && s == to)
        );
        r
    }

    /// Whether `layer` may change schemes in this run: it has switches, or
    /// decisions cover it. Fixed from the start (decisions switch only
    /// contested layers), so every rank lays its momentum out alike.
    pub fn movable(&self, layer: u32) -> bool {
        debug_assert!((layer as usize) < self.switches.len(), "layer {layer}");
        !self.switches[layer as usize].is_empty() || self.contested.contains(&layer)
    }

    /// Whether `layer` comes back to the servers at `iter` (SFB at `iter −
    /// 1`, PS at `iter`): its shard must be written again first.
    pub fn reseeds_at(&self, layer: u32, iter: u64) -> bool {
        self.switches_at(layer, iter, Scheme::Sfb, Scheme::Ps)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sw(layer: u32, iter: u64, scheme: Scheme) -> Switch {
        Switch { layer, iter, scheme }
    }

    #[test]
    fn rounds_and_their_iterations_skip_the_sfb_stretches() {
        let mut p = Plan::new(vec![Scheme::Ps, Scheme::Sfb]);
        p.add(sw(0, 3, Scheme::Sfb)).unwrap();
        p.add(sw(0, 5, Scheme::Ps)).unwrap();
        p.add(sw(1, 2, Scheme::Ps)).unwrap();
        // Layer 0: PS 0..3, SFB 3..5, PS from 5.
        let l0: Vec<Scheme> = (0..7).map(|t| p.scheme(0, t)).collect();
        use Scheme::{Ps, Sfb};
        assert_eq!(l0, [Ps, Ps, Ps, Sfb, Sfb, Ps, Ps]);
        assert_eq!(
            (0..8).map(|n| p.server_rounds(0, n)).collect::<Vec<_>>(),
            [0, 1, 2, 3, 3, 3, 4, 5]
        );
        assert_eq!((0..5).map(|k| p.server_iter(0, k)).collect::<Vec<_>>(), [0, 1, 2, 5, 6]);
        assert_eq!((0..3).map(|k| p.server_iter(1, k)).collect::<Vec<_>>(), [2, 3, 4]);
        assert_eq!(p.server_rounds(1, 4), 2);
        assert_eq!(
            (p.next_sfb(0, 0), p.next_sfb(0, 4), p.next_sfb(0, 5)),
            (Some(3), Some(4), None)
        );
        assert_eq!((p.next_sfb(1, 0), p.next_sfb(1, 2)), (Some(0), None));
        let reseeds: Vec<u64> = (0..8).filter(|&t| p.reseeds_at(0, t)).collect();
        assert_eq!(reseeds, [5]);
        assert!(p.reseeds_at(1, 2) && !p.reseeds_at(1, 0));
        assert_eq!(p.switches().count(), 3);
    }

    /// Drawn plans: a round's iteration is server-held, its rank among the
    /// server-held iterations is `k`, and `server_rounds` counts them.
    #[test]
    fn drawn_plans_agree_with_a_scan() {
        let seed = crate::testkit::seed("TIDEWIRE_PLAN_SEED");
        let mut rng = crate::testkit::Rng(seed);
        for _ in 0..500 {
            let first = if rng.below(2) == 0 { Scheme::Ps } else { Scheme::Sfb };
            let mut p = Plan::new(vec![first]);
            let mut at = 0;
            for _ in 0..rng.below(5) {
                at += 1 + rng.below(4);
                let s = if p.scheme(0, at) == Scheme::Ps {
                    Scheme::Sfb
                } else {
                    Scheme::Ps
                };
                p.add(sw(0, at, s)).unwrap();
            }
            let held: Vec<u64> = (0..40).filter(|&t| p.scheme(0, t) == Scheme::Ps).collect();
            for n in 0..40 {
                assert_eq!(p.server_rounds(0, n), held.iter().filter(|&&t| t < n).count() as u64);
            }
            for (k, &t) in held.iter().enumerate() {
                if t < 30 {
                    assert_eq!(p.server_iter(0, k as u64), t, "{p:?}");
                }
            }
        }
    }

    #[test]
    fn bad_switches_are_refused_by_name() {
        let mut p = Plan::new(vec![Scheme::Ps, Scheme::Adam]);
        assert_eq!(
            p.add(sw(2, 1, Scheme::Sfb)),
            Err(PlanError::UnknownLayer(sw(2, 1, Scheme::Sfb)))
        );
        assert!(matches!(p.add(sw(0, 0, Scheme::Sfb)), Err(PlanError::AtStart(_))));
        assert!(matches!(p.add(sw(0, 2, Scheme::Ps)), Err(PlanError::NoChange(_))));
        assert!(matches!(p.add(sw(1, 2, Scheme::Ps)), Err(PlanError::NotPsSfb(_))));
        p.add(sw(0, 4, Scheme::Sfb)).unwrap();
        let e = p.add(sw(0, 4, Scheme::Ps)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "switch layer 0 to ps at iteration 4: not after the layer's previous switch (iteration 4)"
        );
        assert!(!Plan::new(vec![Scheme::Ps]).has_switches() && p.has_switches());
    }
}
