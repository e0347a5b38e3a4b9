//! A minimal HTTP/1.1 client over any byte stream (tokio's `TcpStream`, turmoil's): what the
//! tests, the simulator's clients and the load generator speak to the server with.

use axum::body::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1;
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};

/// One connection. Requests go one at a time.
#[derive(Debug)]
pub struct Connection {
    sender: http1::SendRequest<Full<Bytes>>,
    /// `Bearer KEY`, sent with every request (`with_api_key`).
    authorization: Option<String>,
}

/// A response whose body arrives in frames (server-sent events come one or more per frame).
#[derive(Debug)]
pub struct Response {
    pub status: StatusCode,
    pub headers: hyper::HeaderMap,
    body: hyper::body::Incoming,
}

impl Connection {
    /// Speaks HTTP/1.1 over `io`; the connection's driver runs as a task of its own.
    pub async fn new<T>(io: T) -> Result<Connection, String>
    where
        T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    {
        let (sender, connection) =
            http1::handshake(TokioIo::new(io)).await.map_err(|e| format!("handshake: {e}"))?;
        tokio::spawn(async move {
            // Ends when either side closes; its error, if any, surfaces on the next request.
            let _ = connection.await;
        });
        Ok(Connection { sender, authorization: None })
    }

    /// This connection, sending `key` as `Authorization: Bearer KEY` (a server's `--api-key`).
    pub fn with_api_key(self, key: &str) -> Connection {
        Connection { authorization: Some(format!("Bearer {key}")), ..self }
    }

    pub async fn request(
        &mut self,
        method: Method,
        path: &str,
        body: Option<&str>,
    ) -> Result<Response, String> {
        let body = Full::new(Bytes::from(body.unwrap_or("").to_owned()));
        let mut request = Request::builder()
            .method(method)
            .uri(path)
            .header("host", "lockstep")
            .header("content-type", "application/json");
        if let Some(authorization) = &self.authorization {
            request = request.header("authorization", authorization);
        }
        let request = request.body(body).map_err(|e| e.to_string())?;
        self.sender.ready().await.map_err(|e| format!("connection: {e}"))?;
        let response = self.sender.send_request(request).await.map_err(|e| format!("send: {e}"))?;
        let (parts, body) = response.into_parts();
        Ok(Response { status: parts.status, headers: parts.headers, body })
    }

    pub async fn post(&mut self, path: &str, body: &str) -> Result<Response, String> {
        self.request(Method::POST, path, Some(body)).await
    }

    pub async fn get(&mut self, path: &str) -> Result<Response, String> {
        self.request(Method::GET, path, None).await
    }
}

impl Response {
    /// The next frame of the body, `None` at its end.
    pub async fn frame(&mut self) -> Result<Option<Bytes>, String> {
        loop {
            match self.body.frame().await {
                None => return Ok(None),
                Some(Err(e)) => return Err(format!("body: {e}")),
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        return Ok(Some(data));
                    }
                }
            }
        }
    }

    /// The whole body as text.
    pub async fn text(mut self) -> Result<String, String> {
        let mut all = Vec::new();
        while let Some(frame) = self.frame().await? {
            all.extend_from_slice(&frame);
        }
        String::from_utf8(all).map_err(|e| e.to_string())
    }

    pub async fn json(self) -> Result<serde_json::Value, String> {
        let text = self.text().await?;
        serde_json::from_str(&text).map_err(|e| format!("{e}: {text}"))
    }

    /// Every `data:` payload of a server-sent event stream, `[DONE]` included.
    pub async fn events(self) -> Result<Vec<String>, String> {
        let text = self.text().await?;
        Ok(sse_data(&text))
    }
}

/// The `data:` payloads of server-sent events in `text`.
pub fn sse_data(text: &str) -> Vec<String> {
    text.split("\n\n")
        .filter_map(|event| {
            let data: Vec<&str> = event
                .lines()
                .filter_map(|l| l.strip_prefix("data:").map(|d| d.strip_prefix(' ').unwrap_or(d)))
                .collect();
            (!data.is_empty()).then(|| data.join("\n"))
        })
        .collect()
}
