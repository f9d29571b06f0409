//! perftest's out-of-band exchange over TCP (port 18515 by default), byte for
//! byte as perftest 4.5 speaks it with `Data ex. method : Ethernet`:
//!
//! | step | bytes | content |
//! |---|---|---|
//! | versions | 16 | `"6.06"`, NUL-padded |
//! | system data | 4 + 4 | cycle buffer and cache line size, big-endian u32 |
//! | MTU | 2 | the verbs MTU code as a decimal string, NUL-terminated |
//! | keys, per QP | 108 (59 without GID) | `LID:OUT_READS:QPN:PSN:RKEY:VADDR:GID[16]:SRQN:` in hex |
//! | sync | 108 | the keys of QP 0 again ([`Oob::sync`]) |
//! | BW report | 5 × 8 | size, iterations, peak, average, message rate: big-endian u64 / f64 |
//! | close | 108 + 5 | a sync, then `"done\0"` |
//!
//! In every exchange the client writes first and then reads; the server reads
//! and then writes. tidewire-perf hides its own test signature in the version
//! message after the NUL (perftest reads the string only), so two
//! tidewire-perf sides refuse mismatched options up front.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use super::error::PerfError;

/// perftest's version string (4.5-0.17 sends "6.06").
pub const VERSION: &str = "6.06";
/// perftest's cycle buffer (the page size).
pub const CYCLE_BUFFER: u32 = 4096;
/// perftest's cache line size.
pub const CACHE_LINE: u32 = 64;
/// Key message with a GID.
pub const KEY_MSG_SIZE_GID: usize = 108;
/// Key message without a GID (InfiniBand with LIDs).
pub const KEY_MSG_SIZE: usize = 59;

/// One side's queue pair, as perftest prints and exchanges it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Dest {
    pub lid: u16,
    pub out_reads: u32,
    pub qpn: u32,
    pub psn: u32,
    pub rkey: u32,
    pub vaddr: u64,
    pub gid: [u8; 16],
    pub srqn: u32,
}

impl Dest {
    /// The key message: 108 bytes with a GID, 59 without (perftest's `KEY_PRINT_FMT[_GID]`).
    ///
    /// Fails when a field is wider than perftest's fixed format (outstanding reads
    /// over 0xffff, a QPN or PSN of 2^24 or more): the message would not fit its
    /// fixed size, and cutting it would hand the peer another SRQN (found by the
    /// `perf_oob` fuzz target).
    pub fn encode(&self, with_gid: bool) -> Result<Vec<u8>, PerfError> {
        if self.out_reads > 0xffff || self.qpn >= 1 << 24 || self.psn >= 1 << 24 {
            return Err(PerfError::new(format!(
                "cannot send key message: out_reads {:#x}, qpn {:#x} or psn {:#x} exceeds perftest's format (16, 24 and 24 bits)",
                self.out_reads, self.qpn, self.psn
            )));
        }
        let mut s = format!(
            "{:04x}:{:04x}:{:06x}:{:06x}:{:08x}:{:016x}:",
            self.lid, self.out_reads, self.qpn, self.psn, self.rkey, self.vaddr
        );
        let size = if with_gid {
            for b in self.gid {
                s.push_str(&format!("{b:02x}:"));
            }
            KEY_MSG_SIZE_GID
        } else {
            KEY_MSG_SIZE
        };
        s.push_str(&format!("{:08x}:", self.srqn));
        let mut v = s.into_bytes();
        debug_assert!(v.len() <= size, "checked fields fit the fixed size");
        v.resize(size, 0);
        Ok(v)
    }

    /// Parses a key message of either size.
    pub fn decode(msg: &[u8]) -> Result<Dest, PerfError> {
        let end = msg.iter().position(|&b| b == 0).unwrap_or(msg.len());
        let text = std::str::from_utf8(&msg[..end])
            .map_err(|_| PerfError::new(format!("peer's key message is not text: {msg:02x?}")))?;
        let f: Vec<&str> = text.split(':').collect();
        let bad = || {
            PerfError::new(format!("cannot parse the peer's key message {text:?} (is the peer perftest or tidewire-perf with the same options?)"))
        };
        let hex = |s: &str| u64::from_str_radix(s, 16).map_err(|_| bad());
        let with_gid = msg.len() == KEY_MSG_SIZE_GID;
        let want = if with_gid { 6 + 16 + 1 } else { 7 };
        if f.len() < want {
            return Err(bad());
        }
        let mut d = Dest {
            lid: hex(f[0])? as u16,
            out_reads: hex(f[1])? as u32,
            qpn: hex(f[2])? as u32,
            psn: hex(f[3])? as u32,
            rkey: hex(f[4])? as u32,
            vaddr: hex(f[5])?,
            ..Default::default()
        };
        if with_gid {
            for i in 0..16 {
                d.gid[i] = hex(f[6 + i])? as u8;
            }
            d.srqn = hex(f[22])? as u32;
        } else {
            d.srqn = hex(f[6])? as u32;
        }
        Ok(d)
    }

    /// perftest's `local address: ...` / `remote address: ...` lines.
    pub fn print(&self, side: &str, show_out: bool, with_gid: bool) -> String {
        let mut s = format!(
            " {side} address: LID {:04x} QPN {:#06x} PSN {:#06x}",
            self.lid, self.qpn, self.psn
        );
        if show_out {
            s.push_str(&format!(" OUT {:#04x}", self.out_reads));
        }
        s.push_str(&format!(" RKey {:#08x} VAddr {:#016x}\n", self.rkey, self.vaddr));
        if with_gid {
            let g: Vec<String> = self.gid.iter().map(|b| format!("{b:02}")).collect();
            s.push_str(&format!(" GID: {}\n", g.join(":")));
        }
        s
    }
}

/// tidewire-perf's test signature, carried after the NUL of the version string.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Signature {
    /// Test id (1..=6, see `Test::id`), plus 0x10 for the TCP transport.
    pub test: u8,
    pub qps: u8,
    /// Bit 0: all sizes (-a); bit 1: duration mode (-D); bit 2: bidirectional.
    pub flags: u8,
    pub size: u32,
    /// Iterations, or seconds in duration mode.
    pub iters: u32,
}

impl Signature {
    fn encode(&self) -> [u8; 11] {
        let mut b = [0u8; 11];
        b[0] = self.test;
        b[1] = self.qps;
        b[2] = self.flags;
        b[3..7].copy_from_slice(&self.size.to_le_bytes());
        b[7..11].copy_from_slice(&self.iters.to_le_bytes());
        b
    }
    fn decode(b: &[u8]) -> Option<Signature> {
        if b.len() < 11 || b[0] == 0 {
            return None; // perftest pads with NULs
        }
        Some(Signature {
            test: b[0],
            qps: b[1],
            flags: b[2],
            size: u32::from_le_bytes(b[3..7].try_into().ok()?),
            iters: u32::from_le_bytes(b[7..11].try_into().ok()?),
        })
    }
}

/// The client's bandwidth report, which a BW server prints (perftest's xchg_bw_reports).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct BwReport {
    pub size: u64,
    pub iters: u64,
    pub bw_peak: f64,
    pub bw_avg: f64,
    pub msg_rate: f64,
}

/// The out-of-band socket and its role.
#[derive(Debug)]
pub struct Oob {
    sock: TcpStream,
    server: bool,
    /// How long one exchange may wait for the peer.
    pub timeout: Duration,
    peer: SocketAddr,
}

impl Oob {
    /// Server: listens on `port` (all addresses) and accepts one client, waiting up
    /// to `wait` (`None`: forever, as perftest does).
    pub fn accept(port: u16, wait: Option<Duration>, timeout: Duration) -> Result<Oob, PerfError> {
        let l = TcpListener::bind(("0.0.0.0", port)).map_err(|e| {
            PerfError::new(format!(
                "cannot listen on port {port}: {e} (is another server running? pick one with -p)"
            ))
        })?;
        let deadline = wait.map(|w| Instant::now() + w);
        l.set_nonblocking(true)
            .map_err(|e| PerfError::new(format!("listener: {e}")))?;
        loop {
            match l.accept() {
                Ok((sock, peer)) => {
                    sock.set_nonblocking(false)
                        .map_err(|e| PerfError::new(format!("socket: {e}")))?;
                    let _ = sock.set_nodelay(true);
                    return Ok(Oob {
                        sock,
                        server: true,
                        timeout,
                        peer,
                    });
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if deadline.is_some_and(|d| Instant::now() >= d) {
                        return Err(PerfError::new(format!(
                            "no client connected to port {port} within {:.0} s",
                            wait.unwrap_or_default().as_secs_f64()
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => return Err(PerfError::new(format!("accept on port {port}: {e}"))),
            }
        }
    }

    /// Client: connects to `host:port`, retrying while the server is not up yet, for up to `timeout`.
    pub fn connect(host: &str, port: u16, timeout: Duration) -> Result<Oob, PerfError> {
        let addrs: Vec<SocketAddr> = (host, port)
            .to_socket_addrs()
            .map_err(|e| PerfError::new(format!("cannot resolve {host}: {e}")))?
            .collect();
        let addr = *addrs
            .first()
            .ok_or_else(|| PerfError::new(format!("{host} has no address")))?;
        let deadline = Instant::now() + timeout;
        let mut last;
        loop {
            let left = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(10));
            match TcpStream::connect_timeout(&addr, left.min(Duration::from_secs(2))) {
                Ok(sock) => {
                    let _ = sock.set_nodelay(true);
                    return Ok(Oob {
                        sock,
                        server: false,
                        timeout,
                        peer: addr,
                    });
                }
                Err(e) => last = e,
            }
            if Instant::now() >= deadline {
                return Err(PerfError::new(format!(
                    "could not connect to the server at {addr} within {:.0} s: {last} (is the server running, on port {port}?)",
                    timeout.as_secs_f64()
                )));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The peer's address.
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    fn read_exact(&mut self, buf: &mut [u8], stage: &str, timeout: Option<Duration>) -> Result<(), PerfError> {
        self.sock
            .set_read_timeout(timeout)
            .map_err(|e| PerfError::new(format!("socket: {e}")))?;
        let mut got = 0;
        while got < buf.len() {
            match self.sock.read(&mut buf[got..]) {
                Ok(0) => {
                    return Err(PerfError::new(format!(
                        "{stage}: the peer {} closed the connection after {got} of {} bytes (it failed, or runs a different test or options; see its output)",
                        self.peer,
                        buf.len()
                    )))
                }
                Ok(n) => got += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                    return Err(PerfError::new(format!(
                        "{stage}: the peer {} did not answer within {:.0} s ({got} of {} bytes)",
                        self.peer,
                        timeout.unwrap_or_default().as_secs_f64(),
                        buf.len()
                    )))
                }
                Err(e) => return Err(PerfError::new(format!("{stage}: reading from {}: {e}", self.peer))),
            }
        }
        Ok(())
    }

    fn write_all(&mut self, buf: &[u8], stage: &str) -> Result<(), PerfError> {
        self.sock
            .set_write_timeout(Some(self.timeout))
            .map_err(|e| PerfError::new(format!("socket: {e}")))?;
        self.sock
            .write_all(buf)
            .map_err(|e| PerfError::new(format!("{stage}: writing to {}: {e}", self.peer)))
    }

    /// One exchange of equal-sized messages: the client writes first, the server reads first.
    pub fn xchg(&mut self, mine: &[u8], stage: &str, timeout: Option<Duration>) -> Result<Vec<u8>, PerfError> {
        let mut theirs = vec![0u8; mine.len()];
        if self.server {
            self.read_exact(&mut theirs, stage, timeout)?;
            self.write_all(mine, stage)?;
        } else {
            self.write_all(mine, stage)?;
            self.read_exact(&mut theirs, stage, timeout)?;
        }
        Ok(theirs)
    }

    /// Versions: ours is "6.06" plus the signature; returns the peer's version and signature.
    pub fn versions(&mut self, sig: Signature) -> Result<(String, Option<Signature>), PerfError> {
        let mut msg = [0u8; 16];
        msg[..VERSION.len()].copy_from_slice(VERSION.as_bytes());
        msg[5..16].copy_from_slice(&sig.encode());
        let t = self.timeout;
        let r = self.xchg(&msg, "exchanging versions", Some(t))?;
        let end = r.iter().position(|&b| b == 0).unwrap_or(r.len());
        let v = String::from_utf8_lossy(&r[..end]).into_owned();
        if v.is_empty() || !v.chars().next().is_some_and(|c| c.is_ascii_digit()) {
            return Err(PerfError::new(format!(
                "the peer at {} is not perftest or tidewire-perf (version message {:02x?})",
                self.peer, &r
            )));
        }
        let sig = if end < 16 {
            Signature::decode(&r[end + 1..])
        } else {
            None
        };
        Ok((v, sig))
    }

    /// System data: cycle buffer and cache line size; returns the peer's.
    pub fn sys_data(&mut self) -> Result<(u32, u32), PerfError> {
        let t = self.timeout;
        let c = self.xchg(&CYCLE_BUFFER.to_be_bytes(), "exchanging system data", Some(t))?;
        let l = self.xchg(&CACHE_LINE.to_be_bytes(), "exchanging system data", Some(t))?;
        Ok((
            u32::from_be_bytes(c[..4].try_into().expect("4 bytes")),
            u32::from_be_bytes(l[..4].try_into().expect("4 bytes")),
        ))
    }

    /// MTU codes (1 = 256 ... 5 = 4096); returns the peer's.
    pub fn mtu(&mut self, code: u8) -> Result<u8, PerfError> {
        let msg = [b'0' + code.min(9), 0];
        let t = self.timeout;
        let r = self.xchg(&msg, "exchanging MTU", Some(t))?;
        match r[0] {
            b'1'..=b'5' => Ok(r[0] - b'0'),
            _ => Err(PerfError::new(format!("the peer sent MTU code {:?}", r))),
        }
    }

    /// Keys of one queue pair; returns the peer's.
    pub fn keys(&mut self, mine: &Dest, with_gid: bool, stage: &str) -> Result<Dest, PerfError> {
        let t = self.timeout;
        let r = self.xchg(&mine.encode(with_gid)?, stage, Some(t))?;
        Dest::decode(&r)
    }

    /// A synchronization point (perftest's ctx_hand_shake): keys of QP 0 both ways.
    /// `timeout` `None` waits as long as the connection lives.
    pub fn sync(
        &mut self,
        mine: &Dest,
        with_gid: bool,
        stage: &str,
        timeout: Option<Duration>,
    ) -> Result<(), PerfError> {
        self.xchg(&mine.encode(with_gid)?, stage, timeout).map(|_| ())
    }

    /// The BW report exchange: five 8-byte big-endian fields, each one exchange.
    pub fn report(&mut self, mine: &BwReport) -> Result<BwReport, PerfError> {
        let t = Some(self.timeout);
        let st = "exchanging BW reports";
        let size = u64::from_be_bytes(self.xchg(&mine.size.to_be_bytes(), st, t)?[..8].try_into().expect("8"));
        let iters = u64::from_be_bytes(self.xchg(&mine.iters.to_be_bytes(), st, t)?[..8].try_into().expect("8"));
        let f = |o: &mut Oob, v: f64| -> Result<f64, PerfError> {
            Ok(f64::from_bits(u64::from_be_bytes(
                o.xchg(&v.to_bits().to_be_bytes(), st, t)?[..8].try_into().expect("8"),
            )))
        };
        let bw_peak = f(self, mine.bw_peak)?;
        let bw_avg = f(self, mine.bw_avg)?;
        let msg_rate = f(self, mine.msg_rate)?;
        Ok(BwReport {
            size,
            iters,
            bw_peak,
            bw_avg,
            msg_rate,
        })
    }

    /// perftest's ctx_close_connection: a sync (waiting up to `timeout`, `None`: while
    /// the connection lives), then "done\0" (not read back).
    pub fn close(mut self, mine: &Dest, with_gid: bool, timeout: Option<Duration>) -> Result<(), PerfError> {
        self.sync(mine, with_gid, "closing", timeout)?;
        self.write_all(b"done\0", "closing")?;
        let _ = self.sock.shutdown(std::net::Shutdown::Write);
        Ok(())
    }

    /// Whether the peer has sent something (a synchronization) that a read would return at once.
    pub fn readable(&mut self) -> Result<bool, PerfError> {
        self.sock
            .set_nonblocking(true)
            .map_err(|e| PerfError::new(format!("socket: {e}")))?;
        let mut b = [0u8; 1];
        let r = self.sock.peek(&mut b);
        self.sock
            .set_nonblocking(false)
            .map_err(|e| PerfError::new(format!("socket: {e}")))?;
        match r {
            Ok(0) => Err(PerfError::new(format!("the peer {} closed the connection", self.peer))),
            Ok(_) => Ok(true),
            Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(false),
            Err(e) => Err(PerfError::new(format!("reading from {}: {e}", self.peer))),
        }
    }

    /// Sends a raw tidewire-perf message of `n` bytes (TCP transport set-up).
    pub fn xchg_u32(&mut self, v: u32, stage: &str) -> Result<u32, PerfError> {
        let t = Some(self.timeout);
        let r = self.xchg(&v.to_be_bytes(), stage, t)?;
        Ok(u32::from_be_bytes(r[..4].try_into().expect("4")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Captured from perftest 4.5-0.17 (Debian 12) on soft-RoCE: ib_write_bw's key message.
    const CAPTURED: &[u8] = b"0000:0001:000011:a2c05f:0000023c:000055c6fcc37000:00:00:00:00:00:00:00:00:00:00:ff:ff:c0:00:02:02:00000000:\0";

    #[test]
    fn key_message_round_trips_perftests_bytes() {
        assert_eq!(CAPTURED.len(), KEY_MSG_SIZE_GID);
        let d = Dest::decode(CAPTURED).unwrap();
        assert_eq!(d.qpn, 0x11);
        assert_eq!(d.psn, 0xa2c05f);
        assert_eq!(d.rkey, 0x23c);
        assert_eq!(d.vaddr, 0x55c6fcc37000);
        assert_eq!(d.out_reads, 1);
        assert_eq!(&d.gid[10..], &[0xff, 0xff, 0xc0, 0, 2, 2]);
        assert_eq!(d.encode(true).unwrap(), CAPTURED);
        let short = d.encode(false).unwrap();
        assert_eq!(short.len(), KEY_MSG_SIZE);
        let back = Dest::decode(&short).unwrap();
        assert_eq!(back, Dest { gid: [0; 16], ..d });
    }

    #[test]
    fn an_out_of_range_key_message_is_refused_not_cut() {
        let ok = Dest {
            lid: 0xffff,
            out_reads: 0xffff,
            qpn: (1 << 24) - 1,
            psn: (1 << 24) - 1,
            rkey: u32::MAX,
            vaddr: u64::MAX,
            gid: [0xff; 16],
            srqn: 0x1234_5678,
        };
        for g in [true, false] {
            let m = ok.encode(g).unwrap();
            let back = Dest::decode(&m).unwrap();
            assert_eq!(back, if g { ok } else { Dest { gid: [0; 16], ..ok } });
        }
        for bad in [
            Dest { qpn: 1 << 24, ..ok },
            Dest { psn: 1 << 24, ..ok },
            Dest {
                out_reads: 0x1_0000,
                ..ok
            },
        ] {
            assert!(bad.encode(true).is_err(), "{bad:?}");
            assert!(bad.encode(false).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn address_lines_match_perftest() {
        let d = Dest::decode(CAPTURED).unwrap();
        assert_eq!(
            d.print("local", false, true),
            " local address: LID 0000 QPN 0x0011 PSN 0xa2c05f RKey 0x00023c VAddr 0x0055c6fcc37000\n \
             GID: 00:00:00:00:00:00:00:00:00:00:255:255:192:00:02:02\n"
        );
        let r = Dest {
            out_reads: 128,
            psn: 0x6b0ee,
            ..d
        };
        assert!(r.print("remote", true, false).contains("PSN 0x6b0ee OUT 0x80 RKey"));
    }

    #[test]
    fn garbage_keys_are_refused() {
        let e = Dest::decode(&[0x7fu8; 108]).unwrap_err();
        assert!(e.to_string().contains("cannot parse"), "{e}");
    }

    #[test]
    fn signature_hides_after_the_version_string() {
        let s = Signature {
            test: 3,
            qps: 2,
            flags: 1,
            size: 65536,
            iters: 5000,
        };
        assert_eq!(Signature::decode(&s.encode()), Some(s));
        assert_eq!(Signature::decode(&[0; 11]), None);
    }

    #[test]
    fn exchange_over_loopback_in_perftest_order() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        drop(l);
        let srv = std::thread::spawn(move || {
            let mut o = Oob::accept(port, Some(Duration::from_secs(10)), Duration::from_secs(5)).unwrap();
            let (v, sig) = o
                .versions(Signature {
                    test: 1,
                    qps: 1,
                    flags: 0,
                    size: 2,
                    iters: 7,
                })
                .unwrap();
            assert_eq!(v, "6.06");
            assert_eq!(sig.unwrap().iters, 9);
            assert_eq!(o.sys_data().unwrap(), (4096, 64));
            assert_eq!(o.mtu(3).unwrap(), 5);
            let r = o.report(&BwReport::default()).unwrap();
            assert_eq!(r.size, 65536);
            assert_eq!(r.bw_avg, 1.5);
        });
        let mut o = Oob::connect("127.0.0.1", port, Duration::from_secs(10)).unwrap();
        let (_, sig) = o
            .versions(Signature {
                test: 1,
                qps: 1,
                flags: 0,
                size: 2,
                iters: 9,
            })
            .unwrap();
        assert_eq!(sig.unwrap().iters, 7);
        o.sys_data().unwrap();
        assert_eq!(o.mtu(5).unwrap(), 3);
        let r = o
            .report(&BwReport {
                size: 65536,
                iters: 10,
                bw_peak: 2.0,
                bw_avg: 1.5,
                msg_rate: 0.1,
            })
            .unwrap();
        assert_eq!(r, BwReport::default());
        srv.join().unwrap();
    }

    #[test]
    fn a_silent_peer_times_out_with_the_stage_named() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        let t0 = Instant::now();
        let mut o = Oob::connect("127.0.0.1", port, Duration::from_millis(300)).unwrap();
        let e = o
            .versions(Signature {
                test: 1,
                qps: 1,
                flags: 0,
                size: 2,
                iters: 1,
            })
            .unwrap_err();
        assert!(e.to_string().contains("exchanging versions"), "{e}");
        assert!(e.to_string().contains("did not answer"), "{e}");
        assert!(t0.elapsed() < Duration::from_secs(5));
        drop(l);
    }

    #[test]
    fn no_server_is_a_clear_error_after_the_timeout() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        drop(l);
        let e = Oob::connect("127.0.0.1", port, Duration::from_millis(400)).unwrap_err();
        assert!(e.to_string().contains("could not connect"), "{e}");
    }
}
