// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The server's endpoints: what each path answers, from the request queue, the
//! tokenizer and the model. A new endpoint is one more handler here.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include <mini_decoder/model/model.hpp>
#include <mini_decoder/server/http_server.hpp>
#include <mini_decoder/server/metrics.hpp>
#include <mini_decoder/server/request_queue.hpp>
#include <mini_decoder/server/server.hpp>

namespace mini_decoder::serving {

class routes {
 public:
  //! `id`: the model name the API reports; `created`: the server's start (seconds since 1970);
  //! `stopping`: set once the server stops accepting (then /health answers 503).
  routes(const model& m, const server_options& o, request_queue& queue, server_metrics& metrics,
         const http_server& http, std::string id, std::int64_t created,
         const std::atomic<bool>& stopping);

  //! Adds every endpoint to `http`: on its workers `POST /v1/completions`,
  //! `POST /v1/chat/completions`, `POST /tokenize`, `POST /detokenize`; on its loop (quick,
  //! so that they answer under any load) `GET /v1/models`, `GET /v1/models/{id}`,
  //! `GET /health`, `GET /metrics`.
  void add_to(http_server& http);

  const std::string& model_id() const { return id_; }

 private:
  //! A completion (`chat` false) or chat completion: parse and check the body, tokenize under
  //! the context's limit, check the lengths, queue one job per choice, answer later.
  http_response generation(const http_request& req, bool chat);
  http_response tokenize(const http_request& req);
  http_response detokenize(const http_request& req);
  http_response health() const;
  //! A response id: `prefix`, the server's start time, a counter.
  std::string next_name(const char* prefix);

  const model& m_;
  const server_options& o_;
  request_queue& queue_;
  server_metrics& metrics_;
  const http_server& http_;
  std::string id_;
  std::int64_t created_ = 0;
  const std::atomic<bool>& stopping_;
  std::atomic<std::uint64_t> next_id_{1};
};

//! `e` as an HTTP response: its status and OpenAI-style JSON body.
http_response error_response(const request_error& e);

}  // namespace mini_decoder::serving
