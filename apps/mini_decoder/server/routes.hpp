// SPDX-License-Identifier: Apache-2.0
//! @file
//! @brief The server's endpoints: what each path answers, from the request queue, the
//! tokenizer and the model. A new endpoint is one more handler here.
#pragma once

#include <httplib.h>

#include <atomic>
#include <cstdint>
#include <string>

#include <mini_decoder/model/model.hpp>
#include <mini_decoder/server/request_queue.hpp>
#include <mini_decoder/server/server.hpp>

namespace mini_decoder::serving {

class routes {
 public:
  //! `id`: the model name the API reports; `created`: the server's start (seconds since 1970).
  routes(const model& m, const server_options& o, request_queue& queue, shared_tokenizer& tok,
         std::string id, std::int64_t created);

  //! Adds every endpoint to `http`: `POST /v1/completions`, `POST /v1/chat/completions`,
  //! `GET /v1/models`, `GET /v1/models/{id}`, `GET /health`.
  void add_to(httplib::Server& http);

  const std::string& model_id() const { return id_; }

 private:
  //! A completion (`chat` false) or chat completion: parse and check the body, tokenize, check
  //! the lengths against the context, queue the request, answer whole or as a stream.
  void generation(const httplib::Request& req, httplib::Response& res, bool chat);
  //! A response id: `prefix`, the server's start time, a counter.
  std::string next_name(const char* prefix);

  const model& m_;
  const server_options& o_;
  request_queue& queue_;
  shared_tokenizer& tok_;
  std::string id_;
  std::int64_t created_ = 0;
  std::atomic<std::uint64_t> next_id_{1};
};

}  // namespace mini_decoder::serving
