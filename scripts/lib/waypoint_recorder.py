#!/usr/bin/env python3
"""Record what a real ztunnel does around a waypoint (used by scripts/record-ztunnel-waypoint.sh).

Roles (sub-commands), each run inside the right network namespace by the shell script:

  mesh VARIANT            print the workloads/services YAML ztunnel is given (LOCAL_XDS_PATH)
  env                     print the topology as shell assignments (single source of truth)
  mkcert                  sign a SPIFFE leaf (EC P-256) with ztunnel's fake root
  waypoint-server         a test waypoint: TLS 1.3 + client cert + ALPN h2, accepts HTTP/2
                          CONNECT, records everything about it, answers 200 and echoes
  tcp-listener            plain TCP listener(s): records the first bytes (a PROXY v2 header if
                          any, decoded) and the local/peer addresses, then echoes
  drive-outbound / drive-inbound
                          run the cases in order (clients through `ip netns exec`), slice
                          ztunnel's log and metrics per case, write the fixture JSON

Everything here is this project's own code; only facts about ztunnel's behaviour came from
reading its source.
"""
import argparse
import datetime
import json
import os
import re
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time

# --- topology (the one place the addresses are defined) --------------------------------------
TOPO = {
    "IP_CLIENT": "10.78.0.1",     # ns A: node A = workload default/client
    "IP_SERVER": "10.78.0.2",     # workload default/server (no host behind it: never dialled)
    "IP_WAYPOINT": "10.78.0.3",   # ns W: node W = workload default/waypoint
    "IP_SERVER2": "10.78.0.4",    # workload default/server2 (waypoint named by the waypoint's pod IP)
    "VIP_SERVER": "10.78.1.2",    # service server.default.svc.cluster.local
    "VIP_WAYPOINT": "10.78.1.3",  # service waypoint.default.svc.cluster.local
    "VIP_BROKEN": "10.78.1.4",    # service broken.default.svc.cluster.local (unknown waypoint)
    "VIP_NOWP": "10.78.1.5",      # service plain.default.svc.cluster.local (no waypoint)
    "IP_UNATTACHED": "10.78.0.9", # an address nothing in the mesh names
    "WAYPOINT_PORT": "15019",     # the waypoint's HBONE port (hboneMtlsPort), deliberately not 15008
    "APP_TUNNEL_PORT": "15088",
    "SUBNET_PODS": "10.78.0.0/24",
    "SUBNET_VIPS": "10.78.1.0/24",
}
T = TOPO
TD = "cluster.local"


def spiffe(ns, sa):
    return f"spiffe://{TD}/ns/{ns}/sa/{sa}"


def mesh_yaml(variant):
    """variant: 'app-tunnel' (the waypoint workload has applicationTunnel PROXY:15088) or
    'no-app-tunnel' (the same without it)."""
    wp = T["WAYPOINT_PORT"]
    app_tunnel = ""
    if variant == "app-tunnel":
        app_tunnel = f"  applicationTunnel: {{protocol: PROXY, port: {T['APP_TUNNEL_PORT']}}}\n"
    elif variant != "no-app-tunnel":
        raise SystemExit(f"unknown mesh variant {variant}")
    return f"""# Mesh state for scripts/record-ztunnel-waypoint.sh (ztunnel LOCAL_XDS_PATH format), variant {variant}.
workloads:
- uid: cluster1//v1/Pod/default/client
  name: client
  namespace: default
  serviceAccount: client
  trustDomain: {TD}
  workloadIps: ["{T['IP_CLIENT']}"]
  protocol: HBONE
  node: nodeA
  network: ""
  clusterId: cluster1
  workloadName: client
  workloadType: deployment
  canonicalName: client
  canonicalRevision: v1
  services: {{}}
- uid: cluster1//v1/Pod/default/server
  name: server
  namespace: default
  serviceAccount: server
  trustDomain: {TD}
  workloadIps: ["{T['IP_SERVER']}"]
  protocol: HBONE
  node: nodeB
  network: ""
  clusterId: cluster1
  workloadName: server
  workloadType: deployment
  canonicalName: server
  canonicalRevision: v1
  # workload-addressed traffic to this pod goes to the waypoint named by its service VIP
  waypoint: {{destination: "/{T['VIP_WAYPOINT']}", hboneMtlsPort: {wp}}}
  services:
    "default/server.default.svc.cluster.local": {{80: 8080}}
    "default/broken.default.svc.cluster.local": {{80: 8080}}
    "default/plain.default.svc.cluster.local": {{80: 8080}}
- uid: cluster1//v1/Pod/default/server2
  name: server2
  namespace: default
  serviceAccount: server2
  trustDomain: {TD}
  workloadIps: ["{T['IP_SERVER2']}"]
  protocol: HBONE
  node: nodeB
  network: ""
  clusterId: cluster1
  # this one names the waypoint by its pod IP
  waypoint: {{destination: "/{T['IP_WAYPOINT']}", hboneMtlsPort: {wp}}}
  services: {{}}
- uid: cluster1//v1/Pod/default/waypoint
  name: waypoint
  namespace: default
  serviceAccount: waypoint
  trustDomain: {TD}
  workloadIps: ["{T['IP_WAYPOINT']}"]
  protocol: HBONE
  node: nodeW
  network: ""
  clusterId: cluster1
  workloadName: waypoint
  workloadType: deployment
  canonicalName: waypoint
  canonicalRevision: v1
{app_tunnel}  services:
    "default/waypoint.default.svc.cluster.local": {{{wp}: {wp}}}
services:
- name: server
  namespace: default
  hostname: server.default.svc.cluster.local
  vips: ["/{T['VIP_SERVER']}"]
  ports: {{80: 8080}}
  waypoint: {{destination: "default/waypoint.default.svc.cluster.local", hboneMtlsPort: {wp}}}
- name: waypoint
  namespace: default
  hostname: waypoint.default.svc.cluster.local
  vips: ["/{T['VIP_WAYPOINT']}"]
  ports: {{{wp}: {wp}}}
- name: broken
  namespace: default
  hostname: broken.default.svc.cluster.local
  vips: ["/{T['VIP_BROKEN']}"]
  ports: {{80: 8080}}
  waypoint: {{destination: "default/nonexistent.default.svc.cluster.local", hboneMtlsPort: {wp}}}
- name: plain
  namespace: default
  hostname: plain.default.svc.cluster.local
  vips: ["/{T['VIP_NOWP']}"]
  ports: {{80: 8080}}
"""


# --- certificates ----------------------------------------------------------------------------
def mkcert(root_cert, root_key, uri, out_cert, out_key):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    ca = x509.load_pem_x509_certificate(open(root_cert, "rb").read())
    ca_key = serialization.load_pem_private_key(open(root_key, "rb").read(), password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([]))          # like Istio's leaves: identity only in the SAN
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.UniformResourceIdentifier(uri)]), critical=True)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=True, content_commitment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    with open(out_cert, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(out_key, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))


def cert_facts(der):
    """SPIFFE id(s) and key type of a DER certificate."""
    if not der:
        return {"present": False}
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    c = x509.load_der_x509_certificate(der)
    try:
        uris = c.extensions.get_extension_for_class(x509.SubjectAlternativeName).value \
            .get_values_for_type(x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        uris = []
    pk = c.public_key()
    if isinstance(pk, ec.EllipticCurvePublicKey):
        kt = f"EC {pk.curve.name}"
    elif isinstance(pk, rsa.RSAPublicKey):
        kt = f"RSA {pk.key_size}"
    else:
        kt = type(pk).__name__
    return {"present": True, "uri_sans": uris, "subject": c.subject.rfc4514_string(),
            "issuer": c.issuer.rfc4514_string(), "key": kt}


def jsonl_append(path, rec, lock=threading.Lock()):
    with lock:
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")


def hostport(s):
    h, p = s.rsplit(":", 1)
    return h.strip("[]"), int(p)


# --- the test waypoint (HBONE server) -------------------------------------------------------
def waypoint_server(args):
    import h2.config
    import h2.connection
    import h2.events

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(args.cert, args.key)
    ctx.load_verify_locations(args.root)
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.set_alpn_protocols(["h2"])
    sni_seen = {}

    def on_sni(sslobj, name, _ctx):
        sni_seen[id(sslobj)] = name
    ctx.sni_callback = on_sni

    lst = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lst.bind(hostport(args.listen))
    lst.listen(64)
    counter = [0]
    print(f"waypoint-server listening on {args.listen}", flush=True)

    def one(raw, peer, conn_no):
        info = {"tls_connection": conn_no, "peer": f"{peer[0]}:{peer[1]}",
                "local": "%s:%d" % raw.getsockname()}
        try:
            raw.settimeout(30)
            s = ctx.wrap_socket(raw, server_side=True)
        except Exception as e:  # noqa: BLE001 - record any handshake failure
            info["tls_error"] = repr(e)
            jsonl_append(args.out, {"event": "tls_failed", **info})
            raw.close()
            return
        info.update({
            "tls_version": s.version(), "cipher": s.cipher()[0], "alpn": s.selected_alpn_protocol(),
            "sni": sni_seen.pop(id(s), None),
            "client_cert": cert_facts(s.getpeercert(binary_form=True)),
        })
        jsonl_append(args.out, {"event": "tls_accepted", **info})
        h2c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False, header_encoding=None))
        h2c.initiate_connection()
        s.sendall(h2c.data_to_send())
        streams = {}
        try:
            while True:
                data = s.recv(65536)
                if not data:
                    break
                for ev in h2c.receive_data(data):
                    if isinstance(ev, h2.events.RemoteSettingsChanged):
                        jsonl_append(args.out, {"event": "client_settings", "tls_connection": conn_no,
                                                "settings": {str(getattr(k, "name", k)): v.new_value
                                                             for k, v in ev.changed_settings.items()}})
                    elif isinstance(ev, h2.events.RequestReceived):
                        hdrs = [[n.decode("latin-1"), v.decode("latin-1")] for n, v in ev.headers]
                        streams[ev.stream_id] = {"headers": hdrs, "first_data": b"", "ended": False,
                                                 "events": ["HEADERS" + (" +END_STREAM" if ev.stream_ended else "")]}
                        rec = {"event": "connect", "tls_connection": conn_no, "stream_id": ev.stream_id,
                               "headers": hdrs, "end_stream_on_headers": ev.stream_ended is not None}
                        rec.update({k: info[k] for k in ("peer", "local", "tls_version", "cipher", "alpn",
                                                         "sni", "client_cert")})
                        streams[ev.stream_id]["rec"] = rec
                        h2c.send_headers(ev.stream_id, [(b":status", b"200")])
                    elif isinstance(ev, h2.events.DataReceived):
                        h2c.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                        st = streams.get(ev.stream_id)
                        if st is not None:
                            st["events"].append("DATA(%d)" % len(ev.data) + (" +END_STREAM" if ev.stream_ended else ""))
                        if st is not None and not st.get("reported"):
                            st["first_data"] += ev.data
                            if b"\n" in st["first_data"] or len(st["first_data"]) >= 256:
                                st["rec"]["first_data"] = st["first_data"].decode("latin-1")
                                jsonl_append(args.out, st["rec"])
                                st["reported"] = True
                        if ev.data:
                            h2c.send_data(ev.stream_id, ev.data)
                    elif isinstance(ev, h2.events.StreamEnded):
                        st = streams.get(ev.stream_id)
                        if st is not None:
                            jsonl_append(args.out, {"event": "stream_closed_by_client", "tls_connection": conn_no,
                                                    "stream_id": ev.stream_id, "frames_from_client": st["events"]})
                        if st is not None and not st.get("reported"):
                            st["rec"]["first_data"] = st["first_data"].decode("latin-1")
                            jsonl_append(args.out, st["rec"])
                            st["reported"] = True
                        try:
                            h2c.end_stream(ev.stream_id)
                        except Exception:  # noqa: BLE001 - already closed
                            pass
                    elif isinstance(ev, h2.events.StreamReset):
                        st = streams.get(ev.stream_id)
                        if st is not None:
                            st["events"].append("RST_STREAM(%d)" % int(ev.error_code))
                        jsonl_append(args.out, {"event": "stream_reset_by_client", "tls_connection": conn_no,
                                                "stream_id": ev.stream_id, "error_code": int(ev.error_code),
                                                "frames_from_client": st["events"] if st else None})
                    elif isinstance(ev, h2.events.ConnectionTerminated):
                        jsonl_append(args.out, {"event": "goaway", "tls_connection": conn_no,
                                                "error_code": int(ev.error_code)})
                out = h2c.data_to_send()
                if out:
                    s.sendall(out)
        except Exception as e:  # noqa: BLE001
            jsonl_append(args.out, {"event": "connection_error", "tls_connection": conn_no, "error": repr(e)})
        finally:
            for sid, st in streams.items():
                if not st.get("reported"):
                    st["rec"]["first_data"] = st["first_data"].decode("latin-1")
                    jsonl_append(args.out, st["rec"])
            jsonl_append(args.out, {"event": "tls_closed", "tls_connection": conn_no})
            s.close()

    while True:
        c, peer = lst.accept()
        counter[0] += 1
        threading.Thread(target=one, args=(c, peer, counter[0]), daemon=True).start()


# --- plain TCP listener: PROXY v2 recorder + echo --------------------------------------------
PP2_SIG = b"\r\n\r\n\x00\r\nQUIT\n"
PP2_TLV_NAMES = {0x01: "PP2_TYPE_ALPN", 0x02: "PP2_TYPE_AUTHORITY", 0x03: "PP2_TYPE_CRC32C",
                 0x04: "PP2_TYPE_NOOP", 0x05: "PP2_TYPE_UNIQUE_ID", 0x20: "PP2_TYPE_SSL",
                 0x30: "PP2_TYPE_NETNS", 0xD0: "istio peer identity (ztunnel PROXY_PROTOCOL_AUTHORITY_TLV)"}


def decode_pp2(b):
    """Decode a PROXY protocol v2 header; returns (decoded dict, header length) or (None, 0)."""
    if len(b) < 16 or not b.startswith(PP2_SIG):
        return None, 0
    ver_cmd, fam, length = b[12], b[13], struct.unpack("!H", b[14:16])[0]
    total = 16 + length
    if len(b) < total:
        return None, 0
    d = {"signature_ok": True, "version": ver_cmd >> 4,
         "command": {0: "LOCAL", 1: "PROXY"}.get(ver_cmd & 0xF, ver_cmd & 0xF),
         "family_byte": "0x%02x" % fam,
         "address_family": {0: "UNSPEC", 1: "INET", 2: "INET6", 3: "UNIX"}.get(fam >> 4, fam >> 4),
         "transport": {0: "UNSPEC", 1: "STREAM", 2: "DGRAM"}.get(fam & 0xF, fam & 0xF),
         "length": length}
    body = b[16:total]
    off = 0
    if fam >> 4 == 1:
        src, dst = socket.inet_ntop(socket.AF_INET, body[0:4]), socket.inet_ntop(socket.AF_INET, body[4:8])
        sp, dp = struct.unpack("!HH", body[8:12])
        off = 12
    elif fam >> 4 == 2:
        src, dst = socket.inet_ntop(socket.AF_INET6, body[0:16]), socket.inet_ntop(socket.AF_INET6, body[16:32])
        sp, dp = struct.unpack("!HH", body[32:36])
        off = 36
    else:
        src = dst = None
        sp = dp = None
    if src is not None:
        d.update({"source": f"{src}:{sp}" if ":" not in src else f"[{src}]:{sp}",
                  "destination": f"{dst}:{dp}" if ":" not in dst else f"[{dst}]:{dp}",
                  "source_addr": src, "source_port": sp, "destination_addr": dst, "destination_port": dp})
    tlvs = []
    while off + 3 <= len(body):
        t, ln = body[off], struct.unpack("!H", body[off + 1:off + 3])[0]
        v = body[off + 3:off + 3 + ln]
        tlvs.append({"type": "0x%02X" % t, "type_name": PP2_TLV_NAMES.get(t, "unknown"), "length": ln,
                     "value_hex": v.hex(), "value_text": v.decode("utf-8", "replace")})
        off += 3 + ln
    d["tlvs"] = tlvs
    return d, total


def tcp_listener(args):
    def serve(addr, lst):
        while True:
            c, peer = lst.accept()
            threading.Thread(target=one, args=(c, peer, addr), daemon=True).start()

    def one(c, peer, listen):
        rec = {"event": "tcp_accepted", "listen": listen, "peer": f"{peer[0]}:{peer[1]}",
               "local": "%s:%d" % c.getsockname()}
        buf = b""
        c.settimeout(3)
        deadline = time.time() + 3
        hdr, hlen = None, 0
        try:
            # read until a complete PROXY header and a first payload line, or a timeout/EOF
            while time.time() < deadline:
                if buf.startswith(PP2_SIG[:min(len(buf), 12)]) and len(buf) >= 16 and hdr is None:
                    hdr, hlen = decode_pp2(buf)
                if hdr is not None or (len(buf) >= 12 and not buf.startswith(PP2_SIG)):
                    if b"\n" in buf[hlen:]:
                        break
                d = c.recv(65536)
                if not d:
                    rec["eof_before_payload"] = True
                    break
                buf += d
        except socket.timeout:
            rec["timeout"] = True
        except OSError as e:
            rec["error"] = repr(e)
        if hdr is None:
            hdr, hlen = decode_pp2(buf)
        rec["proxy_header"] = hdr
        rec["proxy_header_hex"] = buf[:hlen].hex() if hdr else None
        rec["first_bytes_hex"] = buf[:256].hex()
        rec["payload"] = buf[hlen:].decode("latin-1")
        jsonl_append(args.out, rec)
        try:
            c.settimeout(30)
            if buf[hlen:]:
                c.sendall(buf[hlen:])
            while True:
                d = c.recv(65536)
                if not d:
                    break
                c.sendall(d)
        except OSError:
            pass
        c.close()

    for a in args.listen:
        lst = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lst.bind(hostport(a))
        lst.listen(64)
        threading.Thread(target=serve, args=(a, lst), daemon=True).start()
    print(f"tcp-listener listening on {' '.join(args.listen)}", flush=True)
    while True:
        time.sleep(3600)


# --- clients ---------------------------------------------------------------------------------
def app_client(args):
    """A plain TCP app (in the client's namespace, so ztunnel captures it)."""
    r = {"connect": args.connect, "payload": args.payload}
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect(hostport(args.connect))
    except OSError as e:
        r.update(connected=False, outcome="connect_failed", error=repr(e))
        print(json.dumps(r))
        return
    r["connected"] = True
    r["local"] = "%s:%d" % s.getsockname()
    want = (args.payload + "\n").encode()
    got = b""
    try:
        s.sendall(want)
        while len(got) < len(want):
            d = s.recv(65536)
            if not d:
                r["outcome"] = "eof"
                break
            got += d
        else:
            r["outcome"] = "echoed" if got == want else "garbled"
    except ConnectionResetError:
        r["outcome"] = "reset"
    except socket.timeout:
        r["outcome"] = "timeout"
    except OSError as e:
        r["outcome"] = "error"
        r["error"] = repr(e)
    r["received"] = got.decode("latin-1")
    try:
        s.shutdown(socket.SHUT_WR)
        s.settimeout(2)
        while s.recv(65536):
            pass
    except OSError:
        pass
    s.close()
    print(json.dumps(r))


def hbone_client(args):
    """An HBONE client: TLS 1.3 with a SPIFFE client cert, ALPN h2, one HTTP/2 CONNECT."""
    import h2.config
    import h2.connection
    import h2.events

    r = {"connect": args.connect, "authority": args.authority, "payload": args.payload}
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(args.root)
    ctx.load_cert_chain(args.cert, args.key)
    ctx.set_alpn_protocols(["h2"])
    raw = socket.create_connection(hostport(args.connect), timeout=10)
    r["local"] = "%s:%d" % raw.getsockname()
    s = ctx.wrap_socket(raw)
    r.update(tls_version=s.version(), cipher=s.cipher()[0], alpn=s.selected_alpn_protocol(),
             server_cert=cert_facts(s.getpeercert(binary_form=True)))
    h2c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    h2c.initiate_connection()
    sid = h2c.get_next_available_stream_id()
    hdrs = [(b":method", b"CONNECT"), (b":authority", args.authority.encode())]
    for h in args.header or []:
        n, v = h.split(":", 1)
        hdrs.append((n.strip().lower().encode(), v.strip().encode()))
    r["request_headers"] = [[n.decode(), v.decode()] for n, v in hdrs]
    h2c.send_headers(sid, hdrs)
    s.sendall(h2c.data_to_send())
    want = (args.payload + "\n").encode()
    got = b""
    status = None
    done = False
    deadline = time.time() + 10
    seq = []
    r["frames_from_server"] = seq
    try:
        while not done and time.time() < deadline:
            data = s.recv(65536)
            if not data:
                r["connection_closed"] = True
                break
            for ev in h2c.receive_data(data):
                if getattr(ev, "stream_id", None) == sid:
                    if isinstance(ev, h2.events.ResponseReceived):
                        seq.append("HEADERS" + (" +END_STREAM" if ev.stream_ended else ""))
                    elif isinstance(ev, h2.events.DataReceived):
                        seq.append("DATA(%d)" % len(ev.data) + (" +END_STREAM" if ev.stream_ended else ""))
                    elif isinstance(ev, h2.events.StreamReset):
                        seq.append("RST_STREAM(%d)" % int(ev.error_code))
                elif isinstance(ev, h2.events.ConnectionTerminated):
                    seq.append("GOAWAY(%d)" % int(ev.error_code))
                if isinstance(ev, h2.events.ResponseReceived) and ev.stream_id == sid:
                    rh = [[n.decode("latin-1"), v.decode("latin-1")] for n, v in ev.headers]
                    r["response_headers"] = rh
                    status = dict(rh).get(":status")
                    r["status"] = int(status)
                    if ev.stream_ended is not None:
                        r["response_end_stream"] = True
                        done = True
                    elif status == "200":
                        h2c.send_data(sid, want)
                elif isinstance(ev, h2.events.DataReceived) and ev.stream_id == sid:
                    h2c.acknowledge_received_data(ev.flow_controlled_length, sid)
                    got += ev.data
                    if len(got) >= len(want):
                        done = True
                elif isinstance(ev, h2.events.StreamEnded) and ev.stream_id == sid:
                    r["response_end_stream"] = True
                    done = True
                elif isinstance(ev, h2.events.StreamReset) and ev.stream_id == sid:
                    r["stream_reset"] = int(ev.error_code)
                    done = True
                elif isinstance(ev, h2.events.ConnectionTerminated):
                    r["goaway"] = int(ev.error_code)
                    done = True
            out = h2c.data_to_send()
            if out:
                s.sendall(out)
    except OSError as e:
        r["error"] = repr(e)
    if status == "200":
        r["outcome"] = "echoed" if got == want else ("garbled" if got else "no_echo")
        r["received"] = got.decode("latin-1")
        try:
            h2c.end_stream(sid)
            s.sendall(h2c.data_to_send())
            s.settimeout(2)
            end = time.time() + 2
            while time.time() < end and not any(("END_STREAM" in x or "RST_STREAM" in x) for x in seq):
                data = s.recv(65536)
                if not data:
                    break
                for ev in h2c.receive_data(data):
                    if isinstance(ev, h2.events.StreamReset) and ev.stream_id == sid:
                        seq.append("RST_STREAM(%d)" % int(ev.error_code))
                    elif isinstance(ev, h2.events.DataReceived) and ev.stream_id == sid:
                        seq.append("DATA(%d)" % len(ev.data) + (" +END_STREAM" if ev.stream_ended else ""))
                out = h2c.data_to_send()
                if out:
                    s.sendall(out)
        except Exception:  # noqa: BLE001
            pass
    else:
        r["outcome"] = "refused" if status else "no_response"
    try:
        h2c.close_connection()
        s.sendall(h2c.data_to_send())
    except Exception:  # noqa: BLE001
        pass
    s.close()
    print(json.dumps(r))


# --- drivers ---------------------------------------------------------------------------------
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def nsx(ns, *cmd, timeout=30):
    p = subprocess.run(["ip", "netns", "exec", ns, *cmd], capture_output=True, text=True, timeout=timeout)
    return p.stdout


def metrics(ns):
    out = nsx(ns, "curl", "-fsS", "--max-time", "3", "http://127.0.0.1:15020/metrics")
    samples = {}
    for line in out.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)$", line)
        if not m:
            continue
        if not m.group(1).startswith("istio_"):
            continue
        try:
            samples[(m.group(1), m.group(2) or "")] = float(m.group(3))
        except ValueError:
            pass
    return samples


def parse_labels(s):
    return dict(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', s or ""))


def metric_delta(before, after):
    d = []
    for k, v in sorted(after.items()):
        dv = v - before.get(k, 0.0)
        if dv and k[0].startswith("istio_tcp_"):
            d.append({"name": k[0], "delta": dv, "labels": parse_labels(k[1])})
    return d


class LogTail:
    def __init__(self, path):
        self.path = path
        self.off = os.path.getsize(path) if os.path.exists(path) else 0

    def take(self):
        with open(self.path, "rb") as f:
            f.seek(self.off)
            data = f.read()
        self.off += len(data)
        return [ANSI.sub("", l) for l in data.decode("utf-8", "replace").splitlines()]


def access_fields(line):
    """key=value / key="value" pairs of a ztunnel access log line."""
    return {k: (v[1:-1] if v.startswith('"') else v)
            for k, v in re.findall(r'([a-zA-Z_][a-zA-Z0-9_.]*)=("(?:[^"\\]|\\.)*"|\S+)', line)}


def read_jsonl(path):
    if not os.path.exists(path):
        return []
    return [json.loads(l) for l in open(path) if l.strip()]


def wait_for(pred, timeout=5.0):
    end = time.time() + timeout
    while time.time() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.1)
    return pred()


ACCESS = re.compile(r"\taccess\t")
LEVEL = re.compile(r"^\S+\t(warn|error)\t")


def is_access(line):
    return bool(ACCESS.search(line))


def other_log(lines):
    """warn/error lines that are not access lines"""
    return [l for l in lines if LEVEL.match(l) and not is_access(l)]


def ztunnel_meta(args):
    return {"commit": args.zt_commit, "binary_sha256": args.zt_sha256,
            "recorded_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def summarize_outbound(c):
    parts = []
    for r in c["waypoint_connects"]:
        h = dict(r["headers"])
        parts.append(f"CONNECT {h.get(':authority')} sent to the waypoint at {r['local']} "
                     f"(TLS connection #{r['tls_connection']}, stream {r['stream_id']})")
    if not c["waypoint_connects"]:
        parts.append("nothing reached the waypoint")
    if c["connections_to_port_15008_on_waypoint_ip"]:
        parts.append("port 15008 on the waypoint IP was dialled")
    parts.append(f"app: {c['app_saw'].get('outcome')}")
    for f in c["ztunnel_access_log_fields"]:
        if "error" in f:
            parts.append(f"ztunnel: {f['error']}")
    failed = [m for m in c["ztunnel_metrics_delta"] if m["name"] == "istio_tcp_connections_failed_total"]
    parts.append("istio_tcp_connections_failed_total +%d" % sum(m["delta"] for m in failed))
    return "; ".join(parts)


def summarize_inbound(c):
    parts = [f"status {c['status']}"]
    for u in c["upstream_connections"]:
        ph = u.get("proxy_header")
        if ph:
            tl = ", ".join(f"TLV {t['type']}={t['value_text']}" for t in ph["tlvs"])
            parts.append(f"upstream {u['local']} from {u['peer']} with PROXY v2 {ph['source']} -> "
                         f"{ph['destination']} ({tl})")
        else:
            parts.append(f"upstream {u['local']} from {u['peer']} without a PROXY header")
    if not c["upstream_connections"]:
        parts.append("no upstream connection")
    for f in c["ztunnel_access_log_fields"]:
        if "error" in f:
            parts.append(f"ztunnel: {f['error']}")
    return "; ".join(parts)


def drive_outbound(args):
    lib = os.path.abspath(__file__)
    wp_port = int(T["WAYPOINT_PORT"])
    cases = [
        ("a_service_vip", f"{T['VIP_SERVER']}:80",
         "service-addressed: the server service VIP on its port 80; the service's waypoint is named by "
         "hostname (default/waypoint.default.svc.cluster.local, hboneMtlsPort 15019)"),
        ("b_workload_ip", f"{T['IP_SERVER']}:8080",
         "workload-addressed: the server pod IP on 8080; the workload's waypoint is named by the "
         "waypoint service VIP (/10.78.1.3, hboneMtlsPort 15019)"),
        ("b2_workload_ip_waypoint_by_pod_ip", f"{T['IP_SERVER2']}:8080",
         "workload-addressed: server2 pod IP on 8080; its waypoint is named by the waypoint's pod IP "
         "(/10.78.0.3, hboneMtlsPort 15019)"),
        ("c_service_vip_unknown_port", f"{T['VIP_SERVER']}:9999",
         "the server service VIP on a port the service does not have (9999)"),
        ("d_service_unknown_waypoint", f"{T['VIP_BROKEN']}:80",
         "a service whose waypoint names a hostname that does not exist "
         "(default/nonexistent.default.svc.cluster.local)"),
        ("e_service_without_waypoint", f"{T['VIP_NOWP']}:80",
         "control: a service (same server endpoint) with no waypoint: ztunnel should go to the server "
         "directly (HBONE to 10.78.0.2:15008; nothing listens there, so it fails)"),
    ]
    log = LogTail(args.ztunnel_log)
    result_cases = []
    for name, target, desc in cases:
        wp_before = len(read_jsonl(args.waypoint_jsonl))
        trap_before = len(read_jsonl(args.trap_jsonl))
        m0 = metrics(args.ns_client)
        app = json.loads(nsx(args.ns_client, sys.executable, lib, "app-client", "--connect", target,
                             "--payload", f"case={name}") or "{}")
        time.sleep(1.0)
        m1 = metrics(args.ns_client)
        lines = log.take()
        wp = [r for r in read_jsonl(args.waypoint_jsonl)[wp_before:]]
        connects = [r for r in wp if r["event"] == "connect"]
        other = [r for r in wp if r["event"] != "connect"]
        trap = read_jsonl(args.trap_jsonl)[trap_before:]
        acc = [l for l in lines if is_access(l)]
        result_cases.append({
            "name": name, "description": desc,
            "input": {"app_connects_to": target, "app_source": T["IP_CLIENT"], "payload": f"case={name}\n"},
            "app_saw": app,
            "waypoint_connects": connects,
            "waypoint_other_events": other,
            "connections_to_port_15008_on_waypoint_ip": trap,
            "ztunnel_access_log": acc,
            "ztunnel_access_log_fields": [access_fields(l) for l in acc],
            "ztunnel_other_log": other_log(lines),
            "ztunnel_metrics_delta": metric_delta(m0, m1),
        })
        result_cases[-1]["summary"] = summarize_outbound(result_cases[-1])
        print(f"  {name}: {result_cases[-1]['summary']}", flush=True)
    fx = {
        "what": "What a real ztunnel, as the client's node proxy, sends to a waypoint (outbound).",
        "ztunnel": ztunnel_meta(args),
        "mesh_yaml": "mesh.yaml",
        "topology": {
            "client": {"workload": "default/client", "ip": T["IP_CLIENT"], "identity": spiffe("default", "client"),
                       "ztunnel": "PROXY_MODE=dedicated, PROXY_WORKLOAD_INFO=default/client/client, in netns A; "
                                  "nat OUTPUT REDIRECT of TCP to %s and %s, %s → 15001 (mark 0x539/0xfff skipped)"
                                  % (T["SUBNET_VIPS"], T["IP_SERVER"], T["IP_SERVER2"])},
            "waypoint": {"workload": "default/waypoint", "ip": T["IP_WAYPOINT"], "vip": T["VIP_WAYPOINT"],
                         "service": "waypoint.default.svc.cluster.local", "hbone_port": wp_port,
                         "identity": spiffe("default", "waypoint"),
                         "recorder": f"python TLS 1.3 + h2 on {T['IP_WAYPOINT']}:{wp_port} (netns W), client cert "
                                     "required (fake root), ALPN h2; answers 200 to CONNECT and echoes; a plain "
                                     f"TCP trap listens on {T['IP_WAYPOINT']}:15008 to show whether 15008 is dialled"},
            "server": {"workload": "default/server", "ip": T["IP_SERVER"], "vip": T["VIP_SERVER"],
                       "service": "server.default.svc.cluster.local", "ports": {"80": 8080},
                       "service_waypoint": "default/waypoint.default.svc.cluster.local (hostname), hboneMtlsPort 15019",
                       "workload_waypoint": f"/{T['VIP_WAYPOINT']} (address: the waypoint VIP), hboneMtlsPort 15019"},
            "server2": {"workload": "default/server2", "ip": T["IP_SERVER2"],
                        "workload_waypoint": f"/{T['IP_WAYPOINT']} (address: the waypoint pod IP), hboneMtlsPort 15019"},
            "broken": {"service": "broken.default.svc.cluster.local", "vip": T["VIP_BROKEN"],
                       "service_waypoint": "default/nonexistent.default.svc.cluster.local (unknown)"},
            "plain": {"service": "plain.default.svc.cluster.local", "vip": T["VIP_NOWP"], "service_waypoint": None},
        },
        "cases": result_cases,
    }
    with open(args.out, "w") as f:
        json.dump(fx, f, indent=2)
        f.write("\n")


def drive_inbound(args):
    lib = os.path.abspath(__file__)
    variant = args.variant
    if variant == "app-tunnel":
        cases = [
            ("service_vip", f"{T['VIP_SERVER']}:80",
             "server service VIP:80 (the service's waypoint is this waypoint, by hostname)"),
            ("workload_ip", f"{T['IP_SERVER']}:8080",
             "server pod IP:8080 (the workload's waypoint is this waypoint, by the waypoint VIP)"),
            ("service_hostname", "server.default.svc.cluster.local:80",
             "the server service by hostname (HBONE authority as a hostname, not an IP)"),
            ("unattached_ip", f"{T['IP_UNATTACHED']}:8080",
             "an IP nothing in the mesh names (no waypoint attachment)"),
            ("other_workload_without_waypoint", f"{T['IP_CLIENT']}:8080",
             "the client pod's IP: a known workload that has no waypoint"),
            ("service_without_waypoint", f"{T['VIP_NOWP']}:80",
             "a known service that has no waypoint"),
            ("waypoint_own_ip_port_15008", f"{T['IP_WAYPOINT']}:15008",
             "the waypoint's own IP on ztunnel's HBONE port (one of ztunnel's illegal ports)"),
        ]
    else:
        cases = [
            ("service_vip", f"{T['VIP_SERVER']}:80", "server service VIP:80 (service waypoint = this waypoint)"),
            ("workload_ip", f"{T['IP_SERVER']}:8080", "server pod IP:8080 (workload waypoint = this waypoint, by VIP)"),
            ("unattached_ip", f"{T['IP_UNATTACHED']}:8080", "an IP nothing in the mesh names"),
            ("other_workload_without_waypoint", f"{T['IP_CLIENT']}:8080", "the client pod's IP (no waypoint)"),
            ("service_without_waypoint", f"{T['VIP_NOWP']}:80", "a known service that has no waypoint"),
        ]
    log = LogTail(args.ztunnel_log)
    out_cases = []
    for name, authority, desc in cases:
        before = len(read_jsonl(args.listener_jsonl))
        m0 = metrics(args.ns_waypoint)
        hb = json.loads(nsx(args.ns_client, sys.executable, lib, "hbone-client",
                            "--connect", f"{T['IP_WAYPOINT']}:15008", "--authority", authority,
                            "--payload", f"case={variant}/{name}",
                            "--cert", args.cert, "--key", args.key, "--root", args.root) or "{}")
        time.sleep(1.0)
        m1 = metrics(args.ns_waypoint)
        lines = log.take()
        got = read_jsonl(args.listener_jsonl)[before:]
        acc = [l for l in lines if is_access(l)]
        out_cases.append({
            "name": name, "description": desc,
            "input": {"hbone_dial": f"{T['IP_WAYPOINT']}:15008", "authority": authority,
                      "client_identity": spiffe("default", "client"),
                      "request_headers": hb.get("request_headers"), "payload": f"case={variant}/{name}\n"},
            "hbone_client_saw": hb,
            "status": hb.get("status"),
            "upstream_connections": got,
            "ztunnel_access_log": acc,
            "ztunnel_access_log_fields": [access_fields(l) for l in acc],
            "ztunnel_other_log": other_log(lines),
            "ztunnel_metrics_delta": metric_delta(m0, m1),
        })
        out_cases[-1]["summary"] = summarize_inbound(out_cases[-1])
        print(f"  {name}: {out_cases[-1]['summary']}", flush=True)
    res = {"variant": variant, "mesh_yaml": "mesh.yaml" if variant == "app-tunnel" else "mesh-no-app-tunnel.yaml",
           "cases": out_cases}
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)


def assemble_inbound(args):
    variants = [json.load(open(p)) for p in args.parts]
    fx = {
        "what": "What a real ztunnel, as the waypoint's node proxy, does with HBONE CONNECTs addressed "
                "through the waypoint (inbound), with and without an application tunnel (PROXY v2).",
        "ztunnel": ztunnel_meta(args),
        "topology": {
            "waypoint": {"workload": "default/waypoint", "ip": T["IP_WAYPOINT"], "identity": spiffe("default", "waypoint"),
                         "ztunnel": "PROXY_MODE=dedicated, PROXY_WORKLOAD_INFO=default/waypoint/waypoint, in netns W; "
                                    "LOCALHOST_APP_TUNNEL left at its default",
                         "app_tunnel": {"protocol": "PROXY", "port": int(T["APP_TUNNEL_PORT"])},
                         "listeners": "python plain TCP on 0.0.0.0:15088, 0.0.0.0:80, 0.0.0.0:8080 (netns W): "
                                      "records the first bytes, decodes a PROXY v2 header, echoes"},
            "client": {"identity": spiffe("default", "client"), "ip": T["IP_CLIENT"],
                       "hbone_client": "python TLS 1.3 + client cert (fake root) + ALPN h2, one TLS connection "
                                       "per case, CONNECT with only :method and :authority, in netns A"},
            "server": {"ip": T["IP_SERVER"], "vip": T["VIP_SERVER"]},
        },
        "variants": variants,
    }
    with open(args.out, "w") as f:
        json.dump(fx, f, indent=2)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("mesh"); p.add_argument("variant")
    sub.add_parser("env")
    p = sub.add_parser("mkcert")
    for a in ("--root-cert", "--root-key", "--uri", "--out-cert", "--out-key"):
        p.add_argument(a, required=True)
    p = sub.add_parser("waypoint-server")
    for a in ("--listen", "--cert", "--key", "--root", "--out"):
        p.add_argument(a, required=True)
    p = sub.add_parser("tcp-listener"); p.add_argument("--listen", action="append", required=True)
    p.add_argument("--out", required=True)
    p = sub.add_parser("app-client"); p.add_argument("--connect", required=True); p.add_argument("--payload", required=True)
    p = sub.add_parser("hbone-client")
    for a in ("--connect", "--authority", "--payload", "--cert", "--key", "--root"):
        p.add_argument(a, required=True)
    p.add_argument("--header", action="append")
    for name in ("drive-outbound", "drive-inbound", "assemble-inbound"):
        p = sub.add_parser(name)
        p.add_argument("--out", required=True)
        p.add_argument("--zt-commit", default="")
        p.add_argument("--zt-sha256", default="")
        if name == "drive-outbound":
            for a in ("--ns-client", "--ztunnel-log", "--waypoint-jsonl", "--trap-jsonl"):
                p.add_argument(a, required=True)
        if name == "drive-inbound":
            for a in ("--variant", "--ns-client", "--ns-waypoint", "--ztunnel-log", "--listener-jsonl",
                      "--cert", "--key", "--root"):
                p.add_argument(a, required=True)
        if name == "assemble-inbound":
            p.add_argument("parts", nargs="+")
    a = ap.parse_args()
    if a.cmd == "mesh":
        sys.stdout.write(mesh_yaml(a.variant))
    elif a.cmd == "env":
        for k, v in TOPO.items():
            print(f"{k}={v}")
    elif a.cmd == "mkcert":
        mkcert(a.root_cert, a.root_key, a.uri, a.out_cert, a.out_key)
    elif a.cmd == "waypoint-server":
        waypoint_server(a)
    elif a.cmd == "tcp-listener":
        tcp_listener(a)
    elif a.cmd == "app-client":
        app_client(a)
    elif a.cmd == "hbone-client":
        hbone_client(a)
    elif a.cmd == "drive-outbound":
        drive_outbound(a)
    elif a.cmd == "drive-inbound":
        drive_inbound(a)
    elif a.cmd == "assemble-inbound":
        assemble_inbound(a)


if __name__ == "__main__":
    main()
