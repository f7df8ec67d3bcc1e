//! The inbound HBONE `CONNECT` check, on requests built from fuzz bytes: method, request target
//! (authority-form, absolute-form or anything the `http` crate accepts) and headers.
//! Invariants: `Ok(addr)` only for CONNECT whose authority is exactly `addr`; a refusal for a
//! method other than CONNECT is `Method` (405); a CONNECT with an unusable authority is
//! `Authority` (400) and carries the authority it saw.
#![no_main]

use std::net::SocketAddr;

use http::{HeaderName, HeaderValue, Method, Request, StatusCode};
use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use mbtunnel::hbone::{parse_connect, ConnectRefusal};

#[derive(Arbitrary, Debug)]
enum MethodIn {
    Connect,
    Get,
    Post,
    Other(Vec<u8>),
}

#[derive(Arbitrary, Debug)]
enum TargetIn {
    /// `host:port` as HBONE sends it, from arbitrary text.
    Authority(String),
    /// An IP and port rendered the way the client renders them, so the Ok path is reached often.
    Addr { ip: [u8; 16], v6: bool, port: u16 },
    /// `scheme://authority/path`.
    Absolute { scheme: String, authority: String, path: String },
    /// Anything at all.
    Raw(Vec<u8>),
}

#[derive(Arbitrary, Debug)]
struct Input {
    method: MethodIn,
    target: TargetIn,
    headers: Vec<(String, Vec<u8>)>,
}

fuzz_target!(|input: Input| {
    let method = match &input.method {
        MethodIn::Connect => Method::CONNECT,
        MethodIn::Get => Method::GET,
        MethodIn::Post => Method::POST,
        MethodIn::Other(b) => match Method::from_bytes(b) {
            Ok(m) => m,
            Err(_) => return,
        },
    };
    let target: Vec<u8> = match &input.target {
        TargetIn::Authority(a) => a.clone().into_bytes(),
        TargetIn::Addr { ip, v6, port } => {
            let ip: std::net::IpAddr =
                if *v6 { (*ip).into() } else { [ip[0], ip[1], ip[2], ip[3]].into() };
            SocketAddr::new(ip, *port).to_string().into_bytes()
        }
        TargetIn::Absolute { scheme, authority, path } => {
            format!("{scheme}://{authority}/{path}").into_bytes()
        }
        TargetIn::Raw(b) => b.clone(),
    };
    let mut builder = Request::builder().method(method.clone()).uri(target.as_slice());
    for (name, value) in &input.headers {
        let (Ok(n), Ok(v)) =
            (HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_bytes(value))
        else {
            continue;
        };
        builder = builder.header(n, v);
    }
    let Ok(req) = builder.body(()) else { return };
    let authority = req.uri().authority().map(|a| a.as_str().to_string());

    match parse_connect(&req) {
        Ok(addr) => {
            assert_eq!(req.method(), Method::CONNECT, "accepted a non-CONNECT method");
            let a = authority.expect("accepted a request without authority");
            assert_eq!(a.parse::<SocketAddr>(), Ok(addr), "target differs from the authority");
        }
        Err(refusal) => {
            let (status, reason) = (refusal.status(), refusal.reason());
            assert!(!reason.is_empty() && !refusal.to_string().is_empty());
            match refusal {
                ConnectRefusal::Method(m) => {
                    assert_ne!(req.method(), Method::CONNECT, "CONNECT refused as a bad method");
                    assert_eq!(m, req.method().as_str());
                    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
                }
                ConnectRefusal::Authority(a) => {
                    assert_eq!(req.method(), Method::CONNECT, "method must be checked first");
                    assert_eq!(a, authority.clone().unwrap_or_default());
                    assert!(a.parse::<SocketAddr>().is_err(), "refused a valid ip:port '{a}'");
                    assert_eq!(status, StatusCode::BAD_REQUEST);
                }
                other => panic!("parse_connect returned a refusal it cannot know: {other:?}"),
            }
        }
    }
});
