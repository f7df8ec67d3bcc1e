// SPDX-License-Identifier: (BSD-2-Clause OR GPL-2.0-only)
//
// mbtunnel's eBPF redirect: tc classifiers that hand connections of enrolled pods to the node
// proxy's listening sockets with bpf_sk_assign, without NAT (the accepted socket's local address
// is the original destination).
//
//   mbt_from_pod    ingress of the host side of each pod's veth: a pod's new outbound connection
//                   (SYN) goes to the outbound listener (15001); a new connection *to* an
//                   enrolled pod that mbt_to_pod turned back here goes to the inbound listeners;
//   mbt_to_pod      egress of the same interface (what is about to reach the pod): a connection
//                   into an enrolled pod that did not come through the proxy — from a pod outside
//                   the mesh on this node, a hostNetwork pod or a node process — is turned back
//                   to the interface's ingress (bpf_redirect), where mbt_from_pod hands it to the
//                   inbound listeners like one from another node. bpf_sk_assign works at ingress
//                   only, hence the detour. Packets of the proxy's own sockets (socket mark) and
//                   of the kubelet's probes (the probe SNAT addresses) pass. Pods of the node
//                   outside the mesh need mbt_from_pod on their veth too (attached, not
//                   enrolled): their SYNs to enrolled pods are then taken at that ingress; from
//                   a veth without it they are dropped here (unattached);
//   mbt_from_uplink on the node's uplink: a new connection to an enrolled pod goes to the HBONE
//                   listener (15008) when it targets the HBONE port, else to the plaintext
//                   inbound listener (15006).
//
// Every later packet of a connection the proxy owns (the pod's side of an outbound connection,
// the pod's replies to the proxy's transparent dial, the peer's side of an inbound one) is found
// by a socket lookup and marked so that policy routing (`fwmark MARK/MARK lookup TABLE`,
// `local default dev lo table TABLE`, installed by the loader) delivers it locally. Packets of
// connections the proxy does not own pass untouched: enrolling or removing a pod changes new
// connections only.
//
// Built by build.rs with `clang -O2 -target bpf`; loaded by src/redirect/ebpf.rs (aya).

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/ipv6.h>
#include <linux/pkt_cls.h>
#include <linux/tcp.h>

#define SEC(name) __attribute__((section(name), used))
#define INLINE static inline __attribute__((always_inline))

// Helpers by number (no libbpf headers needed).
static void *(*bpf_map_lookup_elem)(void *map, const void *key) = (void *)BPF_FUNC_map_lookup_elem;
static struct bpf_sock *(*bpf_skc_lookup_tcp)(void *ctx, struct bpf_sock_tuple *tuple,
                                              __u32 tuple_size, __u64 netns,
                                              __u64 flags) = (void *)BPF_FUNC_skc_lookup_tcp;
static long (*bpf_sk_release)(void *sk) = (void *)BPF_FUNC_sk_release;
static long (*bpf_sk_assign)(void *ctx, void *sk, __u64 flags) = (void *)BPF_FUNC_sk_assign;
static long (*bpf_skb_load_bytes)(const void *skb, __u32 offset, void *to,
                                  __u32 len) = (void *)BPF_FUNC_skb_load_bytes;
static long (*bpf_skb_store_bytes)(void *skb, __u32 offset, const void *from, __u32 len,
                                   __u64 flags) = (void *)BPF_FUNC_skb_store_bytes;
static long (*bpf_redirect)(__u32 ifindex, __u64 flags) = (void *)BPF_FUNC_redirect;

// Legacy map definitions (the "maps" section), read by aya. `pinning` 1 pins a map by name
// under the loader's pin directory and reuses the one already pinned there (fail-closed mode:
// the maps, and the classifiers attached with pinned links, outlive the proxy process).
struct map_def {
	__u32 type;
	__u32 key_size;
	__u32 value_size;
	__u32 max_entries;
	__u32 map_flags;
	__u32 id;
	__u32 pinning;
};

#ifndef MBT_PINNING
#define MBT_PINNING 0
#endif

// Must match src/redirect/ebpf.rs.
#define LISTENER_OUTBOUND 0
#define LISTENER_HBONE 1
#define LISTENER_PLAINTEXT 2

#define CONFIG_MARK 0
#define CONFIG_HBONE_PORT 1
#define CONFIG_OWN_MARK 2 // the mark of the proxy's own sockets (never turned back)
#define CONFIGS 3

#define STAT_OUTBOUND 0
#define STAT_HBONE 1
#define STAT_PLAINTEXT 2
#define STAT_NO_LISTENER 3
#define STAT_ASSIGN_FAILED 4
#define STAT_STEERED 5
#define STAT_MALFORMED 6
#define STAT_SAME_NODE 7
#define STAT_UNATTACHED 8
#define STATS 16

// parse() results.
#define PARSED 0
#define NOT_TCP -1
#define HIDDEN_TCP -2 // TCP we cannot read: IPv6 extension headers, a truncated first fragment

// The proxy's listening sockets, by LISTENER_*.
SEC("maps") struct map_def mbt_listeners = {BPF_MAP_TYPE_SOCKMAP, 4, 4, 3, 0, 0, MBT_PINNING};
// Enrolled pod addresses: IPv6, or IPv4 as ::ffff:a.b.c.d. Value unused (1).
SEC("maps") struct map_def mbt_pods = {BPF_MAP_TYPE_HASH, 16, 4, 65536, 0, 0, MBT_PINNING};
// CONFIG_*: the routing mark, the HBONE port (host order), the proxy's socket mark.
SEC("maps") struct map_def mbt_config = {BPF_MAP_TYPE_ARRAY, 4, 4, CONFIGS, 0, 0, MBT_PINNING};
// Sources never captured on their way into a pod (the kubelet's probes, SNATed by istio-cni to
// a link-local address), same keys as mbt_pods. Value unused (1).
SEC("maps") struct map_def mbt_bypass = {BPF_MAP_TYPE_HASH, 16, 4, 16, 0, 0, MBT_PINNING};
// Per-CPU counters by STAT_*.
SEC("maps") struct map_def mbt_stats = {BPF_MAP_TYPE_PERCPU_ARRAY, 4, 8, STATS, 0, 0, MBT_PINNING};

struct packet {
	struct bpf_sock_tuple tuple;
	__u32 tuple_len;
	__u8 src[16];
	__u8 dst[16];
	__u16 dport; // host order
	int syn;     // SYN without ACK: a new connection
};

INLINE void count(__u32 stat)
{
	__u64 *v = bpf_map_lookup_elem(&mbt_stats, &stat);
	if (v)
		*v += 1;
}

INLINE __u32 config(__u32 key)
{
	__u32 *v = bpf_map_lookup_elem(&mbt_config, &key);
	return v ? *v : 0;
}

INLINE void v4_mapped(__u8 *out, __be32 addr)
{
	__builtin_memset(out, 0, 10);
	out[10] = 0xff;
	out[11] = 0xff;
	__builtin_memcpy(out + 12, &addr, 4);
}

// Parses Ethernet + IPv4/IPv6 + TCP: PARSED, NOT_TCP (left alone), or HIDDEN_TCP (addresses
// filled in, TCP header unreadable: dropped when an enrolled pod is involved, so that extension
// headers or tiny fragments cannot slip a connection past the proxy).
INLINE int parse(struct __sk_buff *skb, struct packet *p)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct tcphdr *tcp;

	if ((void *)(eth + 1) > end)
		return NOT_TCP;
	if (eth->h_proto == __builtin_bswap16(ETH_P_IP)) {
		struct iphdr *ip = (void *)(eth + 1);
		if ((void *)(ip + 1) > end || ip->protocol != IPPROTO_TCP)
			return NOT_TCP;
		v4_mapped(p->src, ip->saddr);
		v4_mapped(p->dst, ip->daddr);
		if (ip->frag_off & __builtin_bswap16(0x1fff))
			return NOT_TCP; // a later fragment: its first one was judged
		if (ip->ihl < 5)
			return HIDDEN_TCP;
		tcp = (void *)ip + ip->ihl * 4;
		if ((void *)(tcp + 1) > end)
			return HIDDEN_TCP;
		p->tuple.ipv4.saddr = ip->saddr;
		p->tuple.ipv4.daddr = ip->daddr;
		p->tuple.ipv4.sport = tcp->source;
		p->tuple.ipv4.dport = tcp->dest;
		p->tuple_len = sizeof(p->tuple.ipv4);
	} else if (eth->h_proto == __builtin_bswap16(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = (void *)(eth + 1);
		if ((void *)(ip6 + 1) > end)
			return NOT_TCP;
		__builtin_memcpy(p->src, &ip6->saddr, 16);
		__builtin_memcpy(p->dst, &ip6->daddr, 16);
		switch (ip6->nexthdr) {
		case IPPROTO_TCP:
			break;
		case IPPROTO_HOPOPTS:
		case IPPROTO_ROUTING:
		case IPPROTO_FRAGMENT:
		case IPPROTO_DSTOPTS:
			return HIDDEN_TCP; // may carry TCP behind them
		default:
			return NOT_TCP;
		}
		tcp = (void *)(ip6 + 1);
		if ((void *)(tcp + 1) > end)
			return HIDDEN_TCP;
		__builtin_memcpy(p->tuple.ipv6.saddr, &ip6->saddr, 16);
		__builtin_memcpy(p->tuple.ipv6.daddr, &ip6->daddr, 16);
		p->tuple.ipv6.sport = tcp->source;
		p->tuple.ipv6.dport = tcp->dest;
		p->tuple_len = sizeof(p->tuple.ipv6);
	} else {
		return NOT_TCP;
	}
	p->dport = __builtin_bswap16(tcp->dest);
	p->syn = tcp->syn && !tcp->ack;
	return PARSED;
}

// An unreadable TCP packet: dropped (and counted) if `addr` is an enrolled pod.
INLINE int hidden(__u8 *addr)
{
	if (!bpf_map_lookup_elem(&mbt_pods, addr))
		return TC_ACT_OK;
	count(STAT_MALFORMED);
	return TC_ACT_SHOT;
}

INLINE void mark(struct __sk_buff *skb)
{
	skb->mark |= config(CONFIG_MARK);
}

// A new connection: hand it to listener `which`. Without the listener the segment is dropped
// (fail closed: an enrolled pod's traffic never bypasses the proxy while programs are attached).
INLINE int to_listener(struct __sk_buff *skb, __u32 which, __u32 stat)
{
	struct bpf_sock *sk = bpf_map_lookup_elem(&mbt_listeners, &which);
	long err;

	if (!sk) {
		count(STAT_NO_LISTENER);
		return TC_ACT_SHOT;
	}
	err = bpf_sk_assign(skb, sk, 0);
	bpf_sk_release(sk);
	if (err) {
		count(STAT_ASSIGN_FAILED);
		return TC_ACT_SHOT;
	}
	mark(skb);
	count(stat);
	return TC_ACT_OK;
}

// The local socket owning the packet's 4-tuple, if any (to release). The length is a constant
// per branch: the verifier needs it bounded.
INLINE struct bpf_sock *owner(struct __sk_buff *skb, struct packet *p)
{
	if (p->tuple_len == sizeof(p->tuple.ipv4))
		return bpf_skc_lookup_tcp(skb, &p->tuple, sizeof(p->tuple.ipv4), BPF_F_CURRENT_NETNS, 0);
	return bpf_skc_lookup_tcp(skb, &p->tuple, sizeof(p->tuple.ipv6), BPF_F_CURRENT_NETNS, 0);
}

// A later segment: if a local socket (established or still in the handshake) owns its 4-tuple,
// route it locally; otherwise leave it alone.
INLINE int to_owner(struct __sk_buff *skb, struct packet *p)
{
	struct bpf_sock *sk = owner(skb, p);
	if (!sk)
		return TC_ACT_OK;
	if (sk->state != BPF_TCP_LISTEN) {
		mark(skb);
		count(STAT_STEERED);
	}
	bpf_sk_release(sk);
	return TC_ACT_OK;
}

// A new connection to an enrolled pod: HBONE port to the HBONE listener, else plaintext.
INLINE int to_inbound(struct __sk_buff *skb, struct packet *p)
{
	if (p->dport == config(CONFIG_HBONE_PORT))
		return to_listener(skb, LISTENER_HBONE, STAT_HBONE);
	return to_listener(skb, LISTENER_PLAINTEXT, STAT_PLAINTEXT);
}

SEC("classifier/from_pod")
int mbt_from_pod(struct __sk_buff *skb)
{
	struct packet p = {};
	int r = parse(skb, &p);

	if (r == HIDDEN_TCP)
		return hidden(p.src);
	if (r != PARSED)
		return TC_ACT_OK;
	if (!p.syn)
		return to_owner(skb, &p);
	if (bpf_map_lookup_elem(&mbt_pods, p.src))
		return to_listener(skb, LISTENER_OUTBOUND, STAT_OUTBOUND);
	// Not from an enrolled pod but to one: turned back by mbt_to_pod (or a pod sending with
	// another's address): into the pod only through the inbound listeners.
	if (bpf_map_lookup_elem(&mbt_pods, p.dst))
		return to_inbound(skb, &p);
	return TC_ACT_OK;
}

// Whether the packet belongs to one of the proxy's own sockets (its dials toward the app). With
// no socket mark configured nothing can be told apart, and nothing is turned back.
INLINE int own(struct __sk_buff *skb)
{
	__u32 m = config(CONFIG_OWN_MARK);
	return !m || (skb->mark & m) == m;
}

// Sends the packet back in through this interface's ingress, addressed to the interface (the
// source MAC on egress is the interface's own), where mbt_from_pod takes it.
INLINE int turn_back(struct __sk_buff *skb, int syn)
{
	__u8 mac[ETH_ALEN];

	if (bpf_skb_load_bytes(skb, ETH_ALEN, mac, ETH_ALEN) ||
	    bpf_skb_store_bytes(skb, 0, mac, ETH_ALEN, 0))
		return TC_ACT_SHOT;
	if (syn)
		count(STAT_SAME_NODE);
	return bpf_redirect(skb->ifindex, BPF_F_INGRESS);
}

SEC("classifier/to_pod")
int mbt_to_pod(struct __sk_buff *skb)
{
	struct packet p = {};
	int r = parse(skb, &p);

	if (r != PARSED && r != HIDDEN_TCP)
		return TC_ACT_OK;
	if (own(skb))
		return TC_ACT_OK;
	if (r == HIDDEN_TCP)
		return hidden(p.dst);
	if (!bpf_map_lookup_elem(&mbt_pods, p.dst) || bpf_map_lookup_elem(&mbt_bypass, p.src))
		return TC_ACT_OK;
	if (!p.syn) {
		// A later segment: turned back only if the proxy owns its connection (one it took
		// here); connections that predate the enrolment flow on.
		struct bpf_sock *sk = owner(skb, &p);
		int mine;

		if (!sk)
			return TC_ACT_OK;
		mine = sk->state != BPF_TCP_LISTEN;
		bpf_sk_release(sk);
		return mine ? turn_back(skb, 0) : TC_ACT_OK;
	}
	// A new connection forwarded from an interface without our classifier (a pod veth not
	// attached): its later segments would meet the proxy's socket in the forwarding path,
	// which drops them, so it could never complete. Dropped at once instead, and counted.
	if (skb->ingress_ifindex) {
		count(STAT_UNATTACHED);
		return TC_ACT_SHOT;
	}
	return turn_back(skb, 1);
}

SEC("classifier/from_uplink")
int mbt_from_uplink(struct __sk_buff *skb)
{
	struct packet p = {};
	int r = parse(skb, &p);

	if (r == HIDDEN_TCP)
		return hidden(p.dst);
	if (r != PARSED)
		return TC_ACT_OK;
	if (!p.syn)
		return to_owner(skb, &p);
	if (!bpf_map_lookup_elem(&mbt_pods, p.dst))
		return TC_ACT_OK;
	return to_inbound(skb, &p);
}

char _license[] SEC("license") = "Dual BSD/GPL";
