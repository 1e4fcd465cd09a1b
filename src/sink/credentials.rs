//! S3 credentials as AWS users have them: the SDK's credential chain (the
//! AWS_* variables, a profile of the shared config and credentials files
//! with SSO or `credential_process`, web identity, container and instance
//! roles) and an optional role assumed through STS, handed to object_store.
//!
//! object_store asks for a credential before every request, so the answer is
//! cached here and fetched again before it expires: when less than
//! [`REFRESH_BEFORE`] (or half its lifetime, if shorter) is left. A refresh
//! that fails while the current credential is still good keeps it and tries
//! again [`RETRY_REFRESH`] later, so a slow or briefly unreachable STS never
//! fails an upload; only a credential that cannot be had at all, or has run
//! out, fails the request, saying what to set.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use aws_config::profile::ProfileFileCredentialsProvider;
use aws_config::provider_config::ProviderConfig;
use aws_config::sts::AssumeRoleProvider;
use aws_config::{BehaviorVersion, Region};
use aws_credential_types::Credentials;
use aws_credential_types::provider::error::CredentialsError;
use aws_credential_types::provider::{ProvideCredentials, SharedCredentialsProvider};
use aws_sdk_sts::config::http::HttpResponse;
use aws_sdk_sts::error::SdkError;
use aws_sdk_sts::operation::assume_role::AssumeRoleError;
use aws_smithy_http_client::tls::{self, rustls_provider::CryptoMode};
use object_store::CredentialProvider;
use object_store::aws::AwsCredential;
use secrecy::ExposeSecret;
use tokio::sync::OnceCell;

use crate::config::S3Config;
use crate::error::CredentialsFailure;

/// A credential is fetched again when less than this is left of it.
const REFRESH_BEFORE: Duration = Duration::from_secs(300);
/// After a failed refresh, the current credential serves this long before
/// the next try.
const RETRY_REFRESH: Duration = Duration::from_secs(10);
/// A credential with less than this left is not used to sign: the request
/// may arrive after it ran out.
const MIN_LEFT: Duration = Duration::from_secs(15);

/// The object_store credential provider for an S3 destination whose
/// credentials do not come as static keys alone.
pub(crate) struct AwsChain {
    how: How,
    provider: OnceCell<SharedCredentialsProvider>,
    cached: Mutex<Option<Cached>>,
    /// One fetch at a time; the requests that wait for it take its answer.
    fetching: tokio::sync::Mutex<()>,
}

/// Where the chain starts and what it ends with.
struct How {
    /// Static keys from the file (only with a role: alone they need no chain).
    keys: Option<(String, secrecy::SecretString)>,
    profile: Option<String>,
    region: Option<String>,
    role: Option<crate::config::AssumeRole>,
}

struct Cached {
    credential: Arc<AwsCredential>,
    expires: Option<SystemTime>,
    /// When to fetch again (None: never, static keys).
    refresh_at: Option<SystemTime>,
    /// After a failed refresh: not before this.
    retry_at: Option<Instant>,
}

impl std::fmt::Debug for AwsChain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AwsChain")
            .field("profile", &self.how.profile)
            .field("role", &self.how.role.as_ref().map(|r| &r.arn))
            .finish_non_exhaustive()
    }
}

impl AwsChain {
    /// The provider for `s3`, or `None` when the file's static keys are all
    /// there is (object_store signs with them as they are).
    pub(crate) fn for_destination(s3: &S3Config) -> Option<AwsChain> {
        let keys = s3.access_key_id.clone().zip(s3.secret_access_key.clone());
        if keys.is_some() && s3.role.is_none() {
            return None;
        }
        Some(AwsChain {
            how: How {
                keys,
                profile: s3.profile.clone(),
                region: s3.region.clone(),
                role: s3.role.clone(),
            },
            provider: OnceCell::new(),
            cached: Mutex::new(None),
            fetching: tokio::sync::Mutex::new(()),
        })
    }

    /// The SDK's provider, made on first use (loading the shared files and
    /// the region is async).
    async fn provider(&self) -> &SharedCredentialsProvider {
        self.provider
            .get_or_init(|| async {
                // Every call the SDK makes (STS, SSO, instance and container
                // metadata, the region's lookup) goes through this client.
                let http = aws_smithy_http_client::Builder::new()
                    .tls_provider(tls::Provider::Rustls(CryptoMode::Ring))
                    .build_https();
                let providers = ProviderConfig::default().with_http_client(http.clone());
                let mut loader = aws_config::defaults(BehaviorVersion::latest()).http_client(http);
                if let Some(region) = &self.how.region {
                    loader = loader.region(Region::new(region.clone()));
                }
                if let Some(profile) = &self.how.profile {
                    // Named in the configuration: that profile alone, not
                    // the AWS_* variables before it as in the chain.
                    loader = loader.profile_name(profile).credentials_provider(
                        ProfileFileCredentialsProvider::builder()
                            .configure(&providers)
                            .profile_name(profile)
                            .build(),
                    );
                }
                if let Some((id, secret)) = &self.how.keys {
                    loader = loader.credentials_provider(Credentials::new(
                        id,
                        secret.expose_secret(),
                        None,
                        None,
                        "destination.access_key_id",
                    ));
                }
                let mut sdk = loader.load().await;
                if sdk.region().is_none() {
                    // Not configured, nor in AWS_REGION, the profile or the
                    // instance's metadata: STS's global endpoint region.
                    sdk = sdk
                        .into_builder()
                        .region(Region::from_static("us-east-1"))
                        .build();
                }
                match &self.how.role {
                    Some(role) => {
                        let mut builder = AssumeRoleProvider::builder(&role.arn)
                            .session_name(&role.session_name)
                            .configure(&sdk);
                        if let Some(id) = &role.external_id {
                            builder = builder.external_id(id);
                        }
                        SharedCredentialsProvider::new(builder.build().await)
                    }
                    None => sdk
                        .credentials_provider()
                        .expect("aws-config always sets the default chain"),
                }
            })
            .await
    }

    /// The cached credential if it needs no fetch now.
    fn current(&self, now: SystemTime) -> Option<Arc<AwsCredential>> {
        let cached = self.cached.lock().unwrap();
        let c = cached.as_ref()?;
        let due = c.refresh_at.is_some_and(|at| now >= at);
        let waiting = c.retry_at.is_some_and(|at| Instant::now() < at);
        (!due || (waiting && usable(c, now))).then(|| Arc::clone(&c.credential))
    }

    async fn fetch(&self) -> object_store::Result<Arc<AwsCredential>> {
        let _one = self.fetching.lock().await;
        if let Some(c) = self.current(SystemTime::now()) {
            return Ok(c);
        }
        let result = self.provider().await.provide_credentials().await;
        let now = SystemTime::now();
        let mut cached = self.cached.lock().unwrap();
        match result {
            Ok(got) => {
                let expires = got.expiry();
                let credential = Arc::new(AwsCredential {
                    key_id: got.access_key_id().to_string(),
                    secret_key: got.secret_access_key().to_string(),
                    token: got.session_token().map(str::to_string),
                });
                let refresh_at = expires.map(|at| {
                    let life = at.duration_since(now).unwrap_or_default();
                    at - REFRESH_BEFORE.min(life / 2)
                });
                match expires {
                    Some(at) => tracing::debug!(
                        role = self.how.role.as_ref().map(|r| r.arn.as_str()),
                        expires = %humantime::format_rfc3339_seconds(at),
                        "S3 credentials fetched"
                    ),
                    None => tracing::debug!("S3 credentials fetched (no expiry)"),
                }
                *cached = Some(Cached {
                    credential: Arc::clone(&credential),
                    expires,
                    refresh_at,
                    retry_at: None,
                });
                Ok(credential)
            }
            Err(e) => match cached.as_mut().filter(|c| usable(c, now)) {
                Some(c) => {
                    tracing::warn!(
                        error = %chain(&e),
                        "fetching new S3 credentials failed; the current ones serve until they run out, tried again in {}s",
                        RETRY_REFRESH.as_secs()
                    );
                    c.retry_at = Some(Instant::now() + RETRY_REFRESH);
                    Ok(Arc::clone(&c.credential))
                }
                None => Err(self.failure(e)),
            },
        }
    }

    /// The failure as object_store reports it: `Unauthenticated` (waltail
    /// stops and says what to set) when no credential can be had or STS
    /// refused, a generic error (retried) when the provider only failed to
    /// answer in time.
    fn failure(&self, e: CredentialsError) -> object_store::Error {
        let text = chain(&e);
        let status = sts_status(&e);
        // Refused (403 AccessDenied, 400 bad token): asking again gets the
        // same answer.
        let refused = status.is_some_and(|s| s < 500 && s != 429)
            || text.contains("AccessDenied")
            || text.contains("InvalidClientTokenId");
        let transient = match &e {
            CredentialsError::ProviderTimedOut(_) => true,
            CredentialsError::ProviderError(_) | CredentialsError::Unhandled(_) => !refused,
            _ => false,
        };
        let source = Box::new(CredentialsFailure::new(
            text,
            self.how.role.as_ref().map(|r| r.arn.clone()),
            refused,
        ));
        if transient {
            object_store::Error::Generic {
                store: "S3",
                source,
            }
        } else {
            object_store::Error::Unauthenticated {
                path: "(credentials)".into(),
                source,
            }
        }
    }
}

#[async_trait]
impl CredentialProvider for AwsChain {
    type Credential = AwsCredential;

    async fn get_credential(&self) -> object_store::Result<Arc<AwsCredential>> {
        match self.current(SystemTime::now()) {
            Some(c) => Ok(c),
            None => self.fetch().await,
        }
    }
}

/// The HTTP status of STS's answer, when AssumeRole got one.
fn sts_status(e: &CredentialsError) -> Option<u16> {
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(SdkError::ServiceError(answer)) =
            s.downcast_ref::<SdkError<AssumeRoleError, HttpResponse>>()
        {
            return Some(answer.raw().status().as_u16());
        }
        source = s.source();
    }
    None
}

/// Still good long enough to sign a request with.
fn usable(c: &Cached, now: SystemTime) -> bool {
    c.expires.is_none_or(|at| at > now + MIN_LEFT)
}

/// An error and its causes on one line (the SDK's top-level messages are
/// terse: "the credential provider was not enabled", "an error occurred
/// while loading credentials").
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let more = s.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = s.source();
    }
    // The chain lists what it tried on lines of their own: one line here,
    // as every error waltail prints is.
    text.split('\n')
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join("; ")
        .replace(":; ", ": ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cached(expires: Option<SystemTime>, refresh_at: Option<SystemTime>) -> AwsChain {
        let chain = AwsChain {
            how: How {
                keys: None,
                profile: None,
                region: None,
                role: None,
            },
            provider: OnceCell::new(),
            cached: Mutex::new(None),
            fetching: tokio::sync::Mutex::new(()),
        };
        *chain.cached.lock().unwrap() = Some(Cached {
            credential: Arc::new(AwsCredential {
                key_id: "k".into(),
                secret_key: "s".into(),
                token: None,
            }),
            expires,
            refresh_at,
            retry_at: None,
        });
        chain
    }

    #[test]
    fn a_credential_is_fetched_again_only_once_its_refresh_time_comes() {
        let now = SystemTime::now();
        let hour = Duration::from_secs(3600);
        assert!(cached(None, None).current(now).is_some());
        let c = cached(Some(now + hour), Some(now + hour - REFRESH_BEFORE));
        assert!(c.current(now).is_some());
        assert!(c.current(now + hour - REFRESH_BEFORE).is_none());
    }

    #[test]
    fn after_a_failed_refresh_the_current_credential_serves_while_it_is_good() {
        let now = SystemTime::now();
        let c = cached(Some(now + Duration::from_secs(60)), Some(now));
        assert!(c.current(now).is_none(), "due");
        c.cached.lock().unwrap().as_mut().unwrap().retry_at = Some(Instant::now() + RETRY_REFRESH);
        assert!(c.current(now).is_some(), "waiting to retry, still good");
        // Too close to running out: not used even while waiting.
        assert!(c.current(now + Duration::from_secs(50)).is_none());
    }
}
