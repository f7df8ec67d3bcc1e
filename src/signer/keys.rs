//! The key table: each certificate key is registered once, with its multi-buffer precomputation
//! (Montgomery and CRT constants for RSA, the scalar for P-256) done at registration. Entries are
//! reference-counted by the TLS contexts that use them, so a key retires by itself when the last
//! context built on its certificate is gone. Keys never appear in `Debug` output or dumps.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use boring::pkey::{Id, PKey, Private};

use crate::mb::p256::EcdsaKey;
use crate::mb::rsa::RsaPrivateKey;

/// Which queue a key's requests go to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum KeyClass {
    Rsa2048,
    Rsa3072,
    Rsa4096,
    EcdsaP256,
    /// Keys the multi-buffer core does not handle (other sizes, e ≠ 65537, other curves):
    /// always signed one at a time with BoringSSL.
    Other,
}

impl KeyClass {
    pub const ALL: [KeyClass; 5] = [
        KeyClass::Rsa2048,
        KeyClass::Rsa3072,
        KeyClass::Rsa4096,
        KeyClass::EcdsaP256,
        KeyClass::Other,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            KeyClass::Rsa2048 => "rsa-2048",
            KeyClass::Rsa3072 => "rsa-3072",
            KeyClass::Rsa4096 => "rsa-4096",
            KeyClass::EcdsaP256 => "ecdsa-p256",
            KeyClass::Other => "other",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

pub(crate) enum MbKey {
    Rsa(Box<RsaPrivateKey>),
    Ec(EcdsaKey),
    None,
}

/// A registered key.
pub struct KeyEntry {
    pub id: u64,
    pub class: KeyClass,
    /// Why the key is in its class (e.g. why it cannot use the IFMA backend).
    pub route: String,
    /// What the single-op cost depends on (`ecdsa-p256`, `rsa-2048`, …): calibration is per kind.
    pub kind: String,
    pub(crate) pkey: PKey<Private>,
    pub(crate) mb: MbKey,
    /// The calibrated BoringSSL single-op cost of this kind (set by the signer at registration).
    pub(crate) single_op: std::sync::OnceLock<std::time::Duration>,
}

impl KeyEntry {
    /// The calibrated single-op cost of this key's kind, once known.
    pub fn single_op(&self) -> Option<std::time::Duration> {
        self.single_op.get().copied()
    }
}

/// The calibration kind of a key: algorithm and size.
fn kind_of(pkey: &PKey<Private>) -> String {
    match pkey.id() {
        Id::RSA => format!("rsa-{}", pkey.bits()),
        Id::EC => match pkey.ec_key().ok().and_then(|k| k.group().curve_name()) {
            Some(boring::nid::Nid::X9_62_PRIME256V1) => "ecdsa-p256".into(),
            other => format!("ec-{other:?}"),
        },
        other => format!("{other:?}").to_lowercase(),
    }
}

impl fmt::Debug for KeyEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyEntry")
            .field("id", &self.id)
            .field("class", &self.class)
            .finish_non_exhaustive()
    }
}

fn classify(pkey: &PKey<Private>, backend: crate::mb::Backend) -> (KeyClass, MbKey, String) {
    match pkey.id() {
        Id::RSA => {
            let Ok(rsa) = pkey.rsa() else {
                return (KeyClass::Other, MbKey::None, "unreadable RSA key".into());
            };
            match RsaPrivateKey::from_boring(&rsa) {
                Ok(k) => {
                    let route = k.route_on(backend);
                    // IFMA, or the model test backend when forced: the same kernels, 8 lanes.
                    let mb = route.backend.is_multi_buffer();
                    let class = match (mb, k.bits()) {
                        (true, 2048) => KeyClass::Rsa2048,
                        (true, 3072) => KeyClass::Rsa3072,
                        (true, 4096) => KeyClass::Rsa4096,
                        _ => KeyClass::Other,
                    };
                    let mb = if class == KeyClass::Other {
                        MbKey::None
                    } else {
                        MbKey::Rsa(Box::new(k))
                    };
                    (class, mb, route.reason)
                }
                Err(e) => (KeyClass::Other, MbKey::None, e.to_string()),
            }
        }
        Id::EC => match pkey
            .ec_key()
            .map_err(|e| e.to_string())
            .and_then(|k| EcdsaKey::from_boring(&k).map_err(|e| e.to_string()))
        {
            Ok(k) => (KeyClass::EcdsaP256, MbKey::Ec(k), "ECDSA P-256".into()),
            Err(e) => (KeyClass::Other, MbKey::None, e),
        },
        other => (KeyClass::Other, MbKey::None, format!("key type {other:?}")),
    }
}

/// Live keys, by id. Holds weak references: the TLS contexts own the entries.
pub struct KeyTable {
    next: AtomicU64,
    keys: Mutex<HashMap<u64, Weak<KeyEntry>>>,
    /// The signer's backend: keys are classified (batch class or single-op) for it.
    backend: crate::mb::Backend,
}

impl Default for KeyTable {
    /// A table for the process-wide backend ([`crate::mb::backend`]).
    fn default() -> Self {
        KeyTable::for_backend(crate::mb::backend())
    }
}

impl KeyTable {
    /// An empty table whose keys are classified for `backend`.
    pub fn for_backend(backend: crate::mb::Backend) -> Self {
        KeyTable { next: AtomicU64::new(0), keys: Mutex::new(HashMap::new()), backend }
    }

    /// Registers `pkey`, doing the multi-buffer precomputation once.
    pub fn register(&self, pkey: PKey<Private>) -> Arc<KeyEntry> {
        let (class, mb, route) = classify(&pkey, self.backend);
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        if class == KeyClass::Other {
            tracing::info!(key = id, reason = %route, "key signs through BoringSSL single-op (not eligible for the multi-buffer core)");
        }
        let kind = kind_of(&pkey);
        let single_op = std::sync::OnceLock::new();
        let e = Arc::new(KeyEntry { id, class, route, kind, pkey, mb, single_op });
        let mut keys = self.keys.lock().unwrap();
        keys.retain(|_, w| w.strong_count() > 0);
        keys.insert(id, Arc::downgrade(&e));
        e
    }

    /// Number of live keys per class.
    pub fn live(&self) -> Vec<(KeyClass, usize)> {
        let mut keys = self.keys.lock().unwrap();
        keys.retain(|_, w| w.strong_count() > 0);
        let mut counts: HashMap<KeyClass, usize> = HashMap::new();
        for w in keys.values() {
            if let Some(e) = w.upgrade() {
                *counts.entry(e.class).or_default() += 1;
            }
        }
        let mut v: Vec<_> = counts.into_iter().collect();
        v.sort();
        v
    }
}
