//! TLS on the gRPC port, as TF Serving's `--ssl_config_file` sets it up (`server.cc`,
//! `BuildServerCredentials`): the server's key and certificate chain (PEM); with
//! `client_verify`, clients must present a certificate that `custom_ca` signed, otherwise no
//! client certificate is asked for. ALPN offers h2 only: gRPC clients require it.
//!
//! rustls on ring (no OpenSSL); TLS 1.2 and 1.3.

use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use serde::Deserialize;
use tokio_rustls::TlsAcceptor;

/// TF Serving's SSLConfig, as `mpspool start` copies it into pool.json (PEM text inline).
#[derive(Clone, Debug, Deserialize)]
pub struct TlsConfig {
    pub server_key: String,
    pub server_cert: String,
    #[serde(default)]
    pub custom_ca: String,
    #[serde(default)]
    pub client_verify: bool,
}

fn certificates(pem: &str, what: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{what}: not PEM certificates: {e}"))?;
    if certs.is_empty() {
        return Err(format!("{what}: no PEM certificate in it"));
    }
    Ok(certs)
}

/// The acceptor for `config`, or what is wrong with it (one line).
pub fn acceptor(config: &TlsConfig) -> Result<TlsAcceptor, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    if config.server_key.contains("ENCRYPTED") {
        // PKCS#8's "ENCRYPTED PRIVATE KEY", or a traditional key's "Proc-Type: 4,ENCRYPTED":
        // read as any other PEM they were "no items found" or a base64 error.
        return Err(
            "server_key is encrypted: give it unencrypted (no passphrase), as \
                    TF Serving's gRPC takes it"
                .to_string(),
        );
    }
    // Read whenever given, as TF Serving hands it to gRPC whenever it is not empty (and its
    // server does not start on one that is not PEM certificates), client_verify or not.
    let mut roots = RootCertStore::empty();
    if config.client_verify || !config.custom_ca.is_empty() {
        for cert in certificates(&config.custom_ca, "custom_ca")? {
            roots
                .add(cert)
                .map_err(|e| format!("custom_ca: unusable certificate: {e}"))?;
        }
    }
    let chain = certificates(&config.server_cert, "server_cert")?;
    let key = PrivateKeyDer::from_pem_slice(config.server_key.as_bytes())
        .map_err(|e| format!("server_key: not a PEM private key: {e}"))?;
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?;
    let builder = if config.client_verify {
        let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
            .build()
            .map_err(|e| format!("custom_ca: {e}"))?;
        builder.with_client_cert_verifier(verifier)
    } else {
        builder.with_no_client_auth()
    };
    let mut server = builder
        .with_single_cert(chain, key)
        .map_err(|e| unusable_pair(&e.to_string()))?;
    server.alpn_protocols = vec![b"h2".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(server)))
}

/// What a handshake's error means where rustls (webpki) is stricter with client
/// certificates than TF Serving's gRPC (BoringSSL), which takes all of these; appended to
/// the handshake's warning. Empty for other errors.
pub fn client_certificate_hint(error: &str) -> &'static str {
    if error.contains("UnsupportedCertVersion") {
        " (the client's certificate is X.509 v1, which rustls does not take: make a v3 one, \
         openssl x509 -req ... -extfile with extendedKeyUsage=clientAuth)"
    } else if error.contains("CaUsedAsEndEntity") {
        " (the client's certificate is a CA's, CA:TRUE, as openssl req -x509 makes: rustls \
         takes a client certificate that custom_ca signed, not one trusted by itself)"
    } else if error.contains("UnknownIssuer") {
        " (no certificate of custom_ca signed the client's; a client certificate put in \
         custom_ca itself is not trusted by rustls)"
    } else if error.contains("BadSignature") || error.contains("UnsupportedSignatureAlgorithm") {
        " (the client's certificate is signed with a key or algorithm rustls does not take: \
         RSA below 2048 bits, SHA-1)"
    } else {
        ""
    }
}

/// What is wrong with the key and certificate rustls refused, said in a user's terms (every
/// refusal read "do not go together", a v1 certificate's and an unsupported key's too;
/// found by a hunt).
fn unusable_pair(error: &str) -> String {
    if error.contains("UnsupportedCertVersion") {
        format!(
            "server_cert is an X.509 v1 certificate, which the front door's TLS (rustls) does \
             not take: make a v3 one (openssl x509 -req ... -extfile with a subjectAltName) \
             ({error})"
        )
    } else if error.contains("failed to parse private key") {
        format!(
            "server_key is of a type the front door's TLS (rustls on ring) cannot sign with: \
             use RSA of 2048 bits or more, ECDSA P-256 or P-384, or Ed25519 ({error})"
        )
    } else {
        format!("server_key and server_cert do not go together: {error}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_encrypted_key_and_the_pairs_rustls_refuses_are_said_as_such() {
        for key in [
            "-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIIB\n-----END ENCRYPTED PRIVATE KEY-----\n",
            "-----BEGIN RSA PRIVATE KEY-----\nProc-Type: 4,ENCRYPTED\n\nMIIB\n-----END RSA PRIVATE KEY-----\n",
        ] {
            let config = TlsConfig {
                server_key: key.into(),
                server_cert: "nope".into(),
                custom_ca: String::new(),
                client_verify: false,
            };
            let error = acceptor(&config).err().unwrap_or_default();
            assert!(error.starts_with("server_key is encrypted"), "{error}");
        }
        assert!(unusable_pair(
            "invalid peer certificate: Other(OtherError(UnsupportedCertVersion))"
        )
        .starts_with("server_cert is an X.509 v1 certificate"));
        assert!(unusable_pair(
            "unexpected error: failed to parse private key as RSA, ECDSA, or EdDSA"
        )
        .starts_with("server_key is of a type"));
        assert!(unusable_pair("keys do not match")
            .starts_with("server_key and server_cert do not go together"));
    }

    #[test]
    fn bad_pem_is_refused_with_the_field_named() {
        let config = TlsConfig {
            server_key: "nope".into(),
            server_cert: "nope".into(),
            custom_ca: String::new(),
            client_verify: false,
        };
        let error = acceptor(&config).err().unwrap_or_default();
        assert!(error.starts_with("server_cert: "), "{error}");
        let verify = TlsConfig {
            client_verify: true,
            ..config
        };
        assert!(acceptor(&verify).is_err());
    }

    #[test]
    fn client_certificates_rustls_refuses_where_grpc_takes_them_are_explained() {
        let error = "invalid peer certificate: Other(OtherError(CaUsedAsEndEntity))";
        assert!(client_certificate_hint(error).contains("CA:TRUE"));
        let error = "invalid peer certificate: UnknownIssuer";
        assert!(client_certificate_hint(error).contains("not trusted by rustls"));
        let error = "invalid peer certificate: Other(OtherError(UnsupportedCertVersion))";
        assert!(client_certificate_hint(error).contains("X.509 v1"));
        assert_eq!(client_certificate_hint("peer sent no certificates"), "");
    }

    #[test]
    fn a_custom_ca_that_is_not_pem_is_refused_without_client_verify_too() {
        // TF Serving gives it to gRPC whenever it is set, and its server does not start.
        let config = TlsConfig {
            server_key: "nope".into(),
            server_cert: "nope".into(),
            custom_ca: "not a pem".into(),
            client_verify: false,
        };
        let error = acceptor(&config).err().unwrap_or_default();
        assert!(error.starts_with("custom_ca: "), "{error}");
    }
}
