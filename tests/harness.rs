//! Tests of the test tools themselves: the fault-injecting proxy
//! (common::proxy) in front of SeaweedFS and Postgres, and the dedicated
//! Postgres (common::pg).

mod common;

use std::net::ToSocketAddrs;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::pg::DedicatedPg;
use common::proxy::{Mode, Proxy};
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as ObjectPath;
use object_store::{ClientOptions, ObjectStore, ObjectStoreExt, RetryConfig};

/// Like common::admin_store, through `endpoint`, with a 2 s timeout and no retries.
fn store_via(endpoint: &str) -> Arc<dyn ObjectStore> {
    let s3 = common::s3();
    Arc::new(
        AmazonS3Builder::new()
            // First: with_client_options replaces the whole set, with_allow_http included.
            .with_client_options(
                ClientOptions::new()
                    .with_timeout(Duration::from_secs(2))
                    .with_connect_timeout(Duration::from_secs(2)),
            )
            .with_bucket_name(&s3.bucket)
            .with_endpoint(endpoint)
            .with_region("us-east-1")
            .with_access_key_id(&s3.key)
            .with_secret_access_key(&s3.secret)
            .with_virtual_hosted_style_request(false)
            .with_allow_http(true)
            .with_retry(RetryConfig {
                max_retries: 0,
                retry_timeout: Duration::from_secs(2),
                ..Default::default()
            })
            .build()
            .unwrap(),
    )
}

/// PUTs `body` at `key`: Ok(elapsed) or Err((elapsed, error)).
async fn put(
    store: &Arc<dyn ObjectStore>,
    key: &str,
    body: &str,
) -> Result<Duration, (Duration, String)> {
    let start = Instant::now();
    let res = store
        .put(&ObjectPath::from(key), body.to_string().into())
        .await;
    match res {
        Ok(_) => Ok(start.elapsed()),
        Err(e) => Err((start.elapsed(), e.to_string())),
    }
}

async fn read_back(key: &str) -> String {
    let got = common::admin_store()
        .get(&ObjectPath::from(key))
        .await
        .unwrap();
    String::from_utf8(got.bytes().await.unwrap().to_vec()).unwrap()
}

#[tokio::test]
async fn proxy_injects_faults_into_s3_puts() {
    let proxy = Proxy::start(common::s3_addr());
    let store = store_via(&proxy.url());
    let prefix = common::unique("harness");

    let key = format!("{prefix}/pass");
    put(&store, &key, "through the proxy").await.unwrap();
    assert_eq!(read_back(&key).await, "through the proxy");
    assert!(proxy.connections() >= 1);

    proxy.set_mode(Mode::Reset);
    let (took, err) = put(&store, &format!("{prefix}/reset"), "x")
        .await
        .unwrap_err();
    assert!(
        took < Duration::from_secs(1),
        "a reset fails fast: {took:?}"
    );
    eprintln!("reset: {took:?}: {err}");

    proxy.set_mode(Mode::Blackhole);
    let (took, err) = put(&store, &format!("{prefix}/blackhole"), "x")
        .await
        .unwrap_err();
    assert!(
        took >= Duration::from_millis(1900) && took < Duration::from_secs(10),
        "a blackhole fails by the client's timeout: {took:?}"
    );
    eprintln!("blackhole: {took:?}: {err}");

    proxy.set_mode(Mode::CutResponse(20));
    let (took, err) = put(&store, &format!("{prefix}/cut"), "x")
        .await
        .unwrap_err();
    eprintln!("cut response: {took:?}: {err}");

    proxy.set_mode(Mode::Delay(Duration::from_millis(300)));
    let key = format!("{prefix}/delay");
    let took = put(&store, &key, "slowly").await.unwrap();
    assert!(took >= Duration::from_millis(300), "delayed: {took:?}");
    assert_eq!(read_back(&key).await, "slowly");

    // Pass again: the same client works (new connections are normal).
    proxy.set_mode(Mode::Reset);
    put(&store, &format!("{prefix}/reset2"), "x")
        .await
        .unwrap_err();
    proxy.set_mode(Mode::Pass);
    let key = format!("{prefix}/again");
    put(&store, &key, "healed").await.unwrap();
    assert_eq!(read_back(&key).await, "healed");

    // Dropping the proxy closes its listener.
    let addr = proxy.addr();
    drop(proxy);
    assert!(std::net::TcpStream::connect(addr).is_err());
}

async fn connect(url: &str) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
    let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    Ok(client)
}

async fn answer(client: &tokio_postgres::Client) -> Result<i32, tokio_postgres::Error> {
    Ok(client.query_one("SELECT 41 + 1", &[]).await?.get(0))
}

#[tokio::test]
async fn proxy_injects_faults_into_postgres() {
    let cfg: tokio_postgres::Config = common::pg_admin_url().parse().unwrap();
    let host = match &cfg.get_hosts()[0] {
        tokio_postgres::config::Host::Tcp(h) => h.clone(),
        other => panic!("WT_TEST_PG must be a TCP URL, not {other:?}"),
    };
    let port = cfg.get_ports().first().copied().unwrap_or(5432);
    let pg_addr = (host.as_str(), port)
        .to_socket_addrs()
        .unwrap()
        .next()
        .unwrap();
    let proxy = Proxy::start(pg_addr);
    let url = format!(
        "postgres://{}@{}/{}",
        cfg.get_user().unwrap_or("postgres"),
        proxy.addr(),
        cfg.get_dbname().unwrap_or("postgres")
    );

    let client = connect(&url).await.unwrap();
    assert_eq!(answer(&client).await.unwrap(), 42);

    proxy.set_mode(Mode::Reset);
    let start = Instant::now();
    assert!(answer(&client).await.is_err());
    assert!(start.elapsed() < Duration::from_secs(1));
    assert!(connect(&url).await.is_err(), "new connections are reset");

    proxy.set_mode(Mode::Pass);
    let client = connect(&url).await.unwrap();
    assert_eq!(answer(&client).await.unwrap(), 42);

    proxy.set_mode(Mode::Blackhole);
    let hung = tokio::time::timeout(Duration::from_secs(1), answer(&client)).await;
    assert!(hung.is_err(), "a blackholed query hangs");

    proxy.set_mode(Mode::Pass);
    let client = connect(&url).await.unwrap();
    assert_eq!(answer(&client).await.unwrap(), 42);
    assert_eq!(proxy.connections(), 4);
}

#[tokio::test]
async fn dedicated_pg_starts_restarts_and_cleans_up() {
    let pg = DedicatedPg::start();
    let root = pg.root().to_path_buf();
    assert!(root.join("data/PG_VERSION").exists());

    let client = connect(pg.url()).await.unwrap();
    assert_eq!(answer(&client).await.unwrap(), 42);
    let wal_level: String = client
        .query_one("SHOW wal_level", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(wal_level, "logical");

    pg.restart();
    assert!(
        answer(&client).await.is_err(),
        "a restart ends open sessions"
    );
    let client = connect(pg.url()).await.unwrap();
    assert_eq!(answer(&client).await.unwrap(), 42);

    pg.stop();
    assert!(answer(&client).await.is_err());
    assert!(connect(pg.url()).await.is_err(), "stopped");
    pg.start_again();
    let client = connect(pg.url()).await.unwrap();
    assert_eq!(answer(&client).await.unwrap(), 42);

    drop(client);
    drop(pg);
    assert!(!root.exists(), "{} is removed", root.display());
}

/// Byte-level checks with a blocking std client (the proxy serves on its own
/// thread, so blocking the test thread is fine): RST on Reset, exactly N
/// response bytes then EOF on CutResponse, and an idle hang on Blackhole.
#[test]
fn proxy_resets_cuts_and_blackholes_at_the_byte_level() {
    use std::io::{ErrorKind, Read, Write};
    let proxy = Proxy::start(common::s3_addr());
    let request = b"GET / HTTP/1.1\r\nHost: s3\r\nConnection: close\r\n\r\n";

    let mut pass = std::net::TcpStream::connect(proxy.addr()).unwrap();
    pass.write_all(request).unwrap();
    let mut response = Vec::new();
    pass.read_to_end(&mut response).unwrap();
    assert!(response.starts_with(b"HTTP/1.1 "), "{response:?}");

    proxy.set_mode(Mode::CutResponse(5));
    let mut cut = std::net::TcpStream::connect(proxy.addr()).unwrap();
    cut.write_all(request).unwrap();
    let mut response = Vec::new();
    cut.read_to_end(&mut response).unwrap();
    assert_eq!(response, b"HTTP/");

    proxy.set_mode(Mode::Blackhole);
    let mut hung = std::net::TcpStream::connect(proxy.addr()).unwrap();
    hung.set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    hung.write_all(request).unwrap();
    let err = hung.read(&mut [0; 16]).unwrap_err();
    assert!(
        matches!(err.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
        "{err}"
    );

    proxy.set_mode(Mode::Reset);
    let err = hung.read(&mut [0; 16]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ConnectionReset, "open ones: {err}");
    let mut new = std::net::TcpStream::connect(proxy.addr()).unwrap();
    let err = new.read(&mut [0; 16]).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::ConnectionReset, "new ones: {err}");
    assert_eq!(proxy.connections(), 4);
}
