//! Which mesh hostnames a query may mean, by the rules ztunnel applies: the name as asked; the
//! Kubernetes names a short name expands to in the client's namespace; the name with one of the
//! client's search domains taken off (a resolver that appended it), and that name's expansions;
//! then each of those with its leading labels replaced by `*` (ServiceEntry wildcard hosts).
#![forbid(unsafe_code)]

use hickory_proto::rr::Name;

/// A name to look up, and, when it was found by taking a search domain off the query, the
/// shortened name (the answer then carries a CNAME from the query to it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Alias {
    pub name: Name,
    pub stripped: Option<Name>,
}

/// The names of a cluster domain (`cluster.local`): `svc.<domain>` and `<domain>`.
#[derive(Clone, Debug)]
pub struct Domains {
    domain: Name,
    svc: Name,
}

impl Domains {
    pub fn new(cluster_domain: &str) -> Result<Domains, String> {
        let domain = fqdn(cluster_domain)
            .map_err(|e| format!("cluster domain '{cluster_domain}' is not a DNS name: {e}"))?;
        let svc =
            fqdn("svc").expect("a label").append_domain(&domain).map_err(|e| e.to_string())?;
        Ok(Domains { domain, svc })
    }

    /// `<ns>.svc.<domain>`.
    pub fn namespaced(&self, namespace: &str) -> Option<Name> {
        fqdn(namespace).ok()?.append_domain(&self.svc).ok()
    }

    /// The search domains a pod of `namespace` has (kubelet writes them in its resolv.conf):
    /// `<ns>.svc.<domain>`, `svc.<domain>`, `<domain>`.
    pub fn search_domains(&self, namespace: &str) -> Vec<Name> {
        self.namespaced(namespace)
            .into_iter()
            .chain([self.svc.clone(), self.domain.clone()])
            .collect()
    }

    /// Whether `host` (a service hostname, without the trailing dot) is a Kubernetes service
    /// name: it ends in `.svc.<domain>`.
    pub fn is_kube_service(&self, host: &str) -> bool {
        let svc = self.svc.to_utf8();
        host.strip_suffix(svc.trim_end_matches('.')).is_some_and(|rest| rest.ends_with('.'))
    }

    /// What `name` may mean when asked by a pod of `namespace`, in the order they are tried,
    /// without repeats.
    pub fn aliases(&self, namespace: &str, name: &Name) -> Vec<Alias> {
        let mut out: Vec<Alias> = Vec::new();
        let mut add = |a: Alias| {
            if !out.iter().any(|o| o.name == a.name) {
                out.push(a);
            }
        };
        add(Alias { name: name.clone(), stripped: None });
        let Some(ns_domain) = self.namespaced(namespace) else { return out };
        for n in self.kube_fqdns(name, &ns_domain) {
            add(Alias { name: n, stripped: None });
        }
        for search in self.search_domains(namespace) {
            if let Some(short) = trim_domain(name, &search) {
                add(Alias { name: short.clone(), stripped: Some(short.clone()) });
                for n in self.kube_fqdns(&short, &ns_domain) {
                    add(Alias { name: n, stripped: Some(short.clone()) });
                }
            }
        }
        out
    }

    /// The full Kubernetes names a name of 1–4 labels stands for: `a` → `a.<ns>.svc.<d>`;
    /// `a.b` → `a.b.svc.<d>` and `a.b.<ns>.svc.<d>`; `a.b.svc` → `a.b.svc.<d>` (and, as any
    /// 3-label name, `a.b.svc.svc.<d>`); `pod.sub.ns.svc` → `pod.sub.ns.svc.<d>`; longer
    /// names none.
    fn kube_fqdns(&self, name: &Name, ns_domain: &Name) -> Vec<Name> {
        let svc_label = fqdn("svc").expect("a label");
        let join = |a: &Name, b: &Name| a.clone().append_domain(b).ok();
        match name.num_labels() {
            1 => join(name, ns_domain).into_iter().collect(),
            2 => [join(name, &self.svc), join(name, ns_domain)].into_iter().flatten().collect(),
            3 => {
                let mut v = Vec::new();
                if has_domain(name, &svc_label) {
                    v.extend(join(name, &self.domain));
                }
                v.extend(join(name, &self.svc));
                v
            }
            4 if has_domain(name, &svc_label) => join(name, &self.domain).into_iter().collect(),
            _ => Vec::new(),
        }
    }
}

/// `name` and the wildcards that match it, most specific first: `a.b.c` → `a.b.c`, `*.b.c`,
/// `*.c`.
pub fn wildcards(name: &Name) -> Vec<Name> {
    let mut out = vec![name.clone()];
    let mut n = name.clone();
    while n.num_labels() > 1 {
        out.push(n.clone().into_wildcard());
        n = n.base_name();
    }
    out
}

/// A hostname as the mesh state keys it: no trailing dot, lower case.
pub fn host_key(name: &Name) -> String {
    let mut s = name.to_lowercase().to_utf8();
    if s.ends_with('.') {
        s.pop();
    }
    s
}

/// Whether `name` ends with every label of `domain` and has more.
pub fn has_domain(name: &Name, domain: &Name) -> bool {
    if domain.is_wildcard() || name.num_labels() <= domain.num_labels() {
        return false;
    }
    let skip = (name.num_labels() - domain.num_labels()) as usize;
    name.iter().skip(skip).zip(domain.iter()).all(|(a, b)| a.eq_ignore_ascii_case(b))
}

/// `name` without the labels of `domain`, when it ends with them and has more.
pub fn trim_domain(name: &Name, domain: &Name) -> Option<Name> {
    if !has_domain(name, domain) {
        return None;
    }
    let keep = (name.num_labels() - domain.num_labels()) as usize;
    let mut n = Name::from_labels(name.iter().take(keep)).ok()?;
    n.set_fqdn(false);
    Some(n)
}

fn fqdn(s: &str) -> Result<Name, hickory_proto::ProtoError> {
    let mut n = Name::from_utf8(s)?;
    n.set_fqdn(true);
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(s: &str) -> Name {
        Name::from_utf8(s).unwrap()
    }

    fn names(v: &[Alias]) -> Vec<(String, Option<String>)> {
        v.iter().map(|a| (a.name.to_utf8(), a.stripped.as_ref().map(|s| s.to_utf8()))).collect()
    }

    /// The expansions of ztunnel's table (`test_to_kube_fqdns`), client in ns1.
    #[test]
    fn kube_names_of_short_names() {
        let d = Domains::new("cluster.local").unwrap();
        let ns = d.namespaced("ns1").unwrap();
        let cases: &[(&str, &[&str])] = &[
            ("name", &["name.ns1.svc.cluster.local."]),
            ("name.", &["name.ns1.svc.cluster.local."]),
            ("name.ns2", &["name.ns2.svc.cluster.local.", "name.ns2.ns1.svc.cluster.local."]),
            ("name.ns2.svc.", &["name.ns2.svc.cluster.local.", "name.ns2.svc.svc.cluster.local."]),
            ("name.ns2.not-svc.", &["name.ns2.not-svc.svc.cluster.local."]),
            ("pod.sub-domain.ns.svc", &["pod.sub-domain.ns.svc.cluster.local."]),
            ("pod.sub-domain.ns.not-svc", &[]),
            ("name.ns2.svc.cluster.", &[]),
            ("name.ns2.svc.cluster.local", &[]),
            ("www.google.com.", &["www.google.com.svc.cluster.local."]),
            ("a.b.c.d.e", &[]),
        ];
        for (host, want) in cases {
            let got: Vec<String> =
                d.kube_fqdns(&n(host), &ns).iter().map(|x| x.to_utf8()).collect();
            assert_eq!(got, *want, "{host}");
        }
    }

    #[test]
    fn aliases_strip_search_domains_and_expand() {
        let d = Domains::new("cluster.local").unwrap();
        // A resolver appended the pod's first search domain to "echo".
        let got = names(&d.aliases("ns1", &n("echo.ns1.svc.cluster.local.")));
        assert_eq!(got[0], ("echo.ns1.svc.cluster.local.".into(), None));
        assert!(got.contains(&("echo".into(), Some("echo".into()))), "{got:?}");
        // "svc.cluster.local" taken off: "echo.ns1", expanded to its full name, with the CNAME
        // target "echo.ns1".
        assert!(got.contains(&("echo.ns1".into(), Some("echo.ns1".into()))), "{got:?}");
        // Nothing repeats.
        let mut seen = got.clone();
        seen.dedup();
        assert_eq!(seen.len(), got.len());
        // An outside name with a search domain appended.
        let got = names(&d.aliases("ns1", &n("example.com.ns1.svc.cluster.local.")));
        assert!(got.contains(&("example.com".into(), Some("example.com".into()))), "{got:?}");
        // A plain outside name: itself only (3+ labels, no svc).
        let got = names(&d.aliases("ns1", &n("www.example.com.")));
        assert_eq!(
            got,
            vec![
                ("www.example.com.".into(), None),
                ("www.example.com.svc.cluster.local.".into(), None)
            ]
        );
    }

    #[test]
    fn wildcards_and_domains() {
        let w: Vec<String> =
            wildcards(&n("a.b.example.com.")).iter().map(|x| x.to_utf8()).collect();
        assert_eq!(w, ["a.b.example.com.", "*.b.example.com.", "*.example.com.", "*.com."]);
        assert!(has_domain(&n("name.ns.svc.cluster.local"), &n("svc.cluster.local")));
        assert!(has_domain(&n("NAME.ns.SVC.cluster.local"), &n("svc.cluster.local")));
        assert!(!has_domain(&n("name.ns.a.different.domain"), &n("svc.cluster.local")));
        assert!(!has_domain(&n("svc.cluster.local"), &n("svc.cluster.local")));
        assert_eq!(
            trim_domain(&n("name.ns.svc.cluster.local"), &n("svc.cluster.local")),
            Some(n("name.ns"))
        );
        assert_eq!(trim_domain(&n("svc.cluster.local"), &n("svc.cluster.local")), None);
        let d = Domains::new("cluster.local").unwrap();
        assert!(d.is_kube_service("echo.demo.svc.cluster.local"));
        assert!(!d.is_kube_service("svc.cluster.local"));
        assert!(!d.is_kube_service("api.example.com"));
        assert_eq!(host_key(&n("Echo.Demo.svc.cluster.local.")), "echo.demo.svc.cluster.local");
        assert!(Domains::new("bad..domain").is_err());
    }
}
