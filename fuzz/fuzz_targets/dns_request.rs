//! The DNS proxy's request path (`dns::Dns::answer`) on arbitrary packets, over UDP or TCP, from
//! a known client or an unknown source, against a small mesh (services by name, a headless one,
//! a ServiceEntry wildcard host); forwarding fails at once (no upstream).
//! Invariants: nothing panics; a packet shorter than a DNS header gets no answer; every answer
//! parses, is a response, carries the query's id, and over UDP fits what the client accepts
//! (512 bytes, or its EDNS size).
#![no_main]

use std::sync::{Arc, OnceLock};

use hickory_proto::op::{Message, MessageType};
use libfuzzer_sys::fuzz_target;
use mbtunnel::dns::{Dns, DnsConfig, DnsMetrics, Transport, Upstream};
use mbtunnel::state::{store_of_yaml, Workload};

const MESH: &str = r#"
workloads:
- {uid: c, name: client, namespace: demo, ips: [10.0.1.2], node: a}
- {uid: e1, name: echo-1, namespace: demo, ips: [10.0.2.2, "fd00::2"], node: b}
services:
- {name: echo, namespace: demo, vips: [10.96.0.20, "fd00:96::20"], ports: [{port: 80}], workloads: [e1]}
- {name: db, namespace: demo, ports: [{port: 5432}], workloads: [e1]}
- {name: wild, namespace: demo, hostname: "*.wild.example", vips: [240.240.0.2], ports: [{port: 443}]}
"#;

struct World {
    rt: tokio::runtime::Runtime,
    dns: Dns,
    client: Arc<Workload>,
}

fn world() -> &'static World {
    static W: OnceLock<World> = OnceLock::new();
    W.get_or_init(|| {
        let state = Arc::new(store_of_yaml("a", MESH).unwrap());
        let mut reg = prometheus_client::registry::Registry::default();
        let dns = Dns::new(
            &DnsConfig::default(),
            state.clone(),
            Arc::new(Upstream::none("fuzzing")),
            DnsMetrics::register(&mut reg),
        )
        .unwrap();
        let client = state.workload_by_uid("c").unwrap();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        World { rt, dns, client }
    })
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, packet)) = data.split_first() else { return };
    let w = world();
    let transport = if mode & 1 == 0 { Transport::Udp } else { Transport::Tcp };
    let client = (mode & 2 == 0).then_some(&*w.client);
    let out = w.rt.block_on(w.dns.answer(client, packet, transport));
    if packet.len() < 12 {
        assert!(out.is_none(), "an answer to {} bytes", packet.len());
        return;
    }
    let Some(out) = out else { return };
    let m = Message::from_vec(&out).expect("the answer parses");
    assert_eq!(m.message_type(), MessageType::Response);
    assert_eq!(m.id(), u16::from_be_bytes([packet[0], packet[1]]));
    if transport == Transport::Udp {
        let max = Message::from_vec(packet)
            .ok()
            .and_then(|q| q.extensions().as_ref().map(|e| e.max_payload().max(512)))
            .unwrap_or(512);
        assert!(out.len() <= usize::from(max), "{} bytes over UDP (max {max})", out.len());
    }
});
