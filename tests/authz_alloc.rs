//! An authorization decision allocates nothing, however many policies apply (counted with a
//! global allocator in this test binary only).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

struct Counting;
static ALLOCS: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::SeqCst);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        unsafe { System.dealloc(p, l) }
    }
}

#[global_allocator]
static A: Counting = Counting;

#[path = "../benches/authz.rs"]
#[allow(dead_code)]
mod bench;

#[test]
fn a_decision_allocates_nothing() {
    use mbtunnel::authz::{decide, principal_of, Conn};
    for n in [1usize, 1000] {
        let (s, w) = bench::store_with(n);
        for (who, allowed) in [(format!("p{}", n - 1), true), ("nobody".to_string(), false)] {
            let id: mbtunnel::identity::Identity =
                format!("spiffe://cluster.local/ns/demo/sa/{who}").parse().unwrap();
            let p = principal_of(&id);
            let conn = Conn {
                src: Some(&id),
                principal: Some(&p),
                src_ip: "10.1.2.3".parse().unwrap(),
                dst_ip: "10.0.0.9".parse().unwrap(),
                dst_port: 8080,
            };
            let before = ALLOCS.load(Ordering::SeqCst);
            let mut ok = 0;
            for _ in 0..100 {
                ok += decide(&s, &w, &conn, None).allowed() as usize;
            }
            let allocs = ALLOCS.load(Ordering::SeqCst) - before;
            assert_eq!(ok, if allowed { 100 } else { 0 });
            assert_eq!(allocs, 0, "{n} policies, {who}: {allocs} allocations in 100 decisions");
        }
    }
}
