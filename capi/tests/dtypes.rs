//! tw_register_typed: double and half memory on two ranks, staged through
//! float (widened at push, narrowed at pull), and bad dtypes refused.

use std::ffi::{c_int, c_void, CStr, CString};
use std::ptr::null_mut;

use tidewire_c::*;

fn last_error() -> String {
    // SAFETY: tw_last_error returns a NUL-terminated string valid until the next
    // failing call on this thread.
    unsafe { CStr::from_ptr(tw_last_error()) }
        .to_string_lossy()
        .into_owned()
}

fn ok(rc: c_int) {
    assert_eq!(rc, TW_OK, "{}", last_error());
}

const N: usize = 4 * 40;

/// Rank `r`'s gradient value i: small integers, exact in every type.
fn g(r: u32, i: usize) -> f64 {
    ((i * 3 + r as usize * 5) % 9) as f64 - 4.0
}

/// One rank with memory of `dtype`: returns its parameters after one push/pull, as f64.
fn rank(dtype: c_int, r: u32, master: &CString) -> Vec<f64> {
    let size = if dtype == TW_DTYPE_F64 { 8 } else { 2 };
    let enc = |x: f64| -> Vec<u8> {
        match dtype {
            TW_DTYPE_F64 => x.to_le_bytes().to_vec(),
            TW_DTYPE_F16 => half::f16::from_f64(x).to_le_bytes().to_vec(),
            _ => half::bf16::from_f64(x).to_le_bytes().to_vec(),
        }
    };
    let dec = |b: &[u8]| -> f64 {
        match dtype {
            TW_DTYPE_F64 => f64::from_le_bytes(b.try_into().unwrap()),
            TW_DTYPE_F16 => half::f16::from_le_bytes([b[0], b[1]]).to_f64(),
            _ => half::bf16::from_le_bytes([b[0], b[1]]).to_f64(),
        }
    };
    // u64 storage keeps every type aligned.
    let mut params = vec![0u64; N * size / 8 + 1];
    let mut grads = vec![0u64; N * size / 8 + 1];
    let (pb, gb) = (params.as_mut_ptr() as *mut u8, grads.as_mut_ptr() as *mut u8);
    let write = |base: *mut u8, i: usize, x: f64| {
        let e = enc(x);
        // SAFETY: element i lies within the N*size bytes of the vector at base, which
        // the session only touches between a push and its pull.
        unsafe { std::ptr::copy_nonoverlapping(e.as_ptr(), base.add(i * size), size) };
    };
    for i in 0..N {
        write(pb, i, 0.5 + r as f64); // rank 0's 0.5 must win
        write(gb, i, g(r, i));
    }
    let cfg = tw_config_new();
    let mut s = null_mut();
    // SAFETY: cfg is live until freed; params and grads hold N elements of dtype and
    // outlive the session (finalized below); they are read back only after the pull.
    unsafe {
        ok(tw_config_add_layer(cfg, c"w".as_ptr(), TW_LAYER_CONV, 4, 40));
        ok(tw_config_set_apply(cfg, TW_APPLY_SUM, 0.0, 0.0, 0.0));
        ok(tw_config_set_job(cfg, 12, c"capi-dtypes".as_ptr()));
        assert_eq!(
            tw_register_typed(cfg, 9, pb as *mut c_void, N, gb as *mut c_void, N),
            TW_ERR_INVALID_ARGUMENT
        );
        assert!(last_error().contains("dtype 9"), "{}", last_error());
        ok(tw_register_typed(
            cfg,
            dtype,
            pb as *mut c_void,
            N,
            gb as *mut c_void,
            N,
        ));
        ok(tw_init_explicit(cfg, r, 2, 0, master.as_ptr(), &mut s));
        tw_config_free(cfg);
        let bytes = std::slice::from_raw_parts(pb, N * size);
        assert!(bytes.chunks(size).all(|c| dec(c) == 0.5), "rank 0's initial values");
        ok(tw_push(s, 0));
        ok(tw_pull(s, 0));
        let out: Vec<f64> = std::slice::from_raw_parts(pb, N * size).chunks(size).map(dec).collect();
        ok(tw_finalize(s));
        out
    }
}

#[test]
fn double_and_half_memory_sum_in_float() {
    for dtype in [TW_DTYPE_F64, TW_DTYPE_F16, TW_DTYPE_BF16] {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let master = CString::new(format!("127.0.0.1:{port}")).unwrap();
        let m1 = master.clone();
        let h = std::thread::spawn(move || rank(dtype, 1, &m1));
        let p0 = rank(dtype, 0, &master);
        let p1 = h.join().unwrap();
        let want: Vec<f64> = (0..N).map(|i| g(0, i) + g(1, i)).collect();
        assert_eq!(p0, want, "dtype {dtype}");
        assert_eq!(p1, want, "dtype {dtype}");
    }
}
