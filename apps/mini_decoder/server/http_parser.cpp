// SPDX-License-Identifier: Apache-2.0
#include <mini_decoder/server/http_parser.hpp>

#include <algorithm>
#include <cctype>
#include <cstdint>

namespace mini_decoder::serving {

namespace {

// RFC 9110's tchar: the characters of a method or a field name.
bool is_tchar(char c) {
  const auto u = static_cast<unsigned char>(c);
  if (std::isalnum(u) != 0) {
    return true;
  }
  switch (c) {
    case '!':
    case '#':
    case '$':
    case '%':
    case '&':
    case '\'':
    case '*':
    case '+':
    case '-':
    case '.':
    case '^':
    case '_':
    case '`':
    case '|':
    case '~':
      return true;
    default:
      return false;
  }
}

bool is_token(std::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), is_tchar);
}

// A field value's characters: visible ASCII, space, tab and obs-text; never CR, LF or NUL.
bool is_field_value(std::string_view s) {
  return std::all_of(s.begin(), s.end(), [](char c) {
    const auto u = static_cast<unsigned char>(c);
    return u == '\t' || (u >= 0x20 && u != 0x7F);
  });
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) {
    s.remove_prefix(1);
  }
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) {
    s.remove_suffix(1);
  }
  return s;
}

std::string lower(std::string_view s) {
  std::string r(s);
  for (char& c : r) {
    c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  }
  return r;
}

// Whether the comma-separated list `v` holds `token` (case-insensitive), as Connection does.
bool has_token(std::string_view v, std::string_view token) {
  while (!v.empty()) {
    const std::size_t comma = v.find(',');
    const std::string_view item = trim(v.substr(0, comma));
    if (lower(item) == token) {
      return true;
    }
    if (comma == std::string_view::npos) {
      break;
    }
    v.remove_prefix(comma + 1);
  }
  return false;
}

head_error refuse(int status, std::string message) {
  return {status, std::move(message)};
}

}  // namespace

std::size_t head_end(std::string_view in, std::size_t from) {
  std::size_t i = from >= 3 ? from - 3 : 0;
  for (; i < in.size(); ++i) {
    if (in[i] != '\n') {
      continue;
    }
    // "\n\n" or "\n\r\n": a line that ends, then an empty one.
    if (i + 1 < in.size() && in[i + 1] == '\n') {
      return i + 2;
    }
    if (i + 2 < in.size() && in[i + 1] == '\r' && in[i + 2] == '\n') {
      return i + 3;
    }
  }
  return std::string_view::npos;
}

std::optional<head_error> parse_head(std::string_view head, const head_limits& limits,
                                     request_head& out) {
  if (head.size() > limits.max_header_bytes) {
    return refuse(431, "the request head is " + std::to_string(head.size()) +
                           " bytes, more than the limit of " +
                           std::to_string(limits.max_header_bytes));
  }
  // Lines, each without its LF or CRLF; a lone CR inside one is refused below.
  std::vector<std::string_view> lines;
  for (std::size_t at = 0; at < head.size();) {
    std::size_t nl = head.find('\n', at);
    if (nl == std::string_view::npos) {
      nl = head.size();
    }
    std::string_view line = head.substr(at, nl - at);
    if (!line.empty() && line.back() == '\r') {
      line.remove_suffix(1);
    }
    lines.push_back(line);
    at = nl + 1;
  }
  while (!lines.empty() && lines.back().empty()) {
    lines.pop_back();
  }
  // RFC 9112 2.2: empty lines before the request line are ignored.
  std::size_t first = 0;
  while (first < lines.size() && lines[first].empty()) {
    ++first;
  }
  if (first == lines.size()) {
    return refuse(400, "the request has no request line");
  }
  // The request line: method SP target SP HTTP/1.x, single spaces.
  const std::string_view rl = lines[first];
  const std::size_t sp1 = rl.find(' ');
  const std::size_t sp2 = sp1 == std::string_view::npos ? sp1 : rl.find(' ', sp1 + 1);
  if (sp2 == std::string_view::npos || rl.find(' ', sp2 + 1) != std::string_view::npos) {
    return refuse(400, "malformed request line (want: METHOD /path HTTP/1.1)");
  }
  const std::string_view method = rl.substr(0, sp1);
  const std::string_view target = rl.substr(sp1 + 1, sp2 - sp1 - 1);
  const std::string_view version = rl.substr(sp2 + 1);
  if (!is_token(method)) {
    return refuse(400, "malformed request method");
  }
  if (version.size() != 8 || version.substr(0, 5) != "HTTP/" ||
      std::isdigit(static_cast<unsigned char>(version[5])) == 0 || version[6] != '.' ||
      std::isdigit(static_cast<unsigned char>(version[7])) == 0) {
    return refuse(400, "malformed HTTP version");
  }
  if (version[5] != '1' || (version[7] != '0' && version[7] != '1')) {
    return refuse(505, "HTTP version " + std::string(version.substr(5)) +
                           " is not supported: this server speaks HTTP/1.0 and HTTP/1.1");
  }
  if (target.empty() || target[0] != '/' || !std::all_of(target.begin(), target.end(), [](char c) {
        const auto u = static_cast<unsigned char>(c);
        return u > 0x20 && u < 0x7F;
      })) {
    return refuse(400, "the request target must be a path starting with '/'");
  }
  http_request& r = out.request;
  r.method = std::string(method);
  r.target = std::string(target);
  const std::size_t q = target.find('?');
  r.path = std::string(target.substr(0, q));
  r.query = q == std::string_view::npos ? std::string() : std::string(target.substr(q + 1));
  r.minor = version[7] - '0';
  r.headers.clear();
  if (lines.size() - first - 1 > limits.max_headers) {
    return refuse(431, "the request has " + std::to_string(lines.size() - first - 1) +
                           " header fields, more than the limit of " +
                           std::to_string(limits.max_headers));
  }
  for (std::size_t i = first + 1; i < lines.size(); ++i) {
    const std::string_view line = lines[i];
    if (line.empty()) {
      return refuse(400, "an empty line inside the header fields");
    }
    if (line[0] == ' ' || line[0] == '\t') {
      return refuse(400, "obsolete line folding in a header field");
    }
    const std::size_t colon = line.find(':');
    if (colon == std::string_view::npos || !is_token(line.substr(0, colon))) {
      return refuse(400, "malformed header field (want: Name: value)");
    }
    const std::string_view value = trim(line.substr(colon + 1));
    if (!is_field_value(value)) {
      return refuse(400, "a header field value holds a control character");
    }
    r.headers.emplace_back(lower(line.substr(0, colon)), std::string(value));
  }
  // What the fields say of the connection and the body.
  std::size_t hosts = 0;
  bool has_length = false, has_encoding = false, close = false, keep = false;
  std::string encoding;
  std::uint64_t length = 0;
  out.expect_continue = false;
  for (const auto& [name, value] : r.headers) {
    if (name == "host") {
      ++hosts;
    } else if (name == "content-length") {
      if (value.empty() || value.size() > 18 ||
          !std::all_of(value.begin(), value.end(),
                       [](char c) { return std::isdigit(static_cast<unsigned char>(c)) != 0; })) {
        return refuse(400, "Content-Length must be one decimal number");
      }
      const std::uint64_t n = std::stoull(value);
      if (has_length && n != length) {
        return refuse(400, "two Content-Length fields that differ");
      }
      has_length = true;
      length = n;
    } else if (name == "transfer-encoding") {
      has_encoding = true;
      encoding = lower(value);
    } else if (name == "connection") {
      close = close || has_token(value, "close");
      keep = keep || has_token(value, "keep-alive");
    } else if (name == "expect") {
      if (lower(value) != "100-continue") {
        return refuse(417, "Expect: only 100-continue is understood");
      }
      out.expect_continue = r.minor == 1;
    }
  }
  (void)keep;  // HTTP/1.0 keep-alive is not offered: such a connection closes after its answer
  if (r.minor == 1 && hosts != 1) {
    return refuse(400, hosts == 0 ? "HTTP/1.1 requests must have a Host header field"
                                  : "more than one Host header field");
  }
  if (has_encoding) {
    if (has_length) {
      return refuse(400, "both Transfer-Encoding and Content-Length");
    }
    if (has_token(encoding, "chunked")) {
      return refuse(411, "send the body with a Content-Length, not chunked");
    }
    return refuse(501, "Transfer-Encoding '" + encoding + "' is not supported");
  }
  out.content_length = static_cast<std::size_t>(length);
  out.keep_alive = r.minor == 1 && !close;
  return std::nullopt;
}

const char* reason_phrase(int status) {
  switch (status) {
    case 100:
      return "Continue";
    case 200:
      return "OK";
    case 204:
      return "No Content";
    case 400:
      return "Bad Request";
    case 401:
      return "Unauthorized";
    case 403:
      return "Forbidden";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 408:
      return "Request Timeout";
    case 411:
      return "Length Required";
    case 413:
      return "Content Too Large";
    case 414:
      return "URI Too Long";
    case 415:
      return "Unsupported Media Type";
    case 417:
      return "Expectation Failed";
    case 421:
      return "Misdirected Request";
    case 422:
      return "Unprocessable Content";
    case 429:
      return "Too Many Requests";
    case 431:
      return "Request Header Fields Too Large";
    case 500:
      return "Internal Server Error";
    case 501:
      return "Not Implemented";
    case 503:
      return "Service Unavailable";
    case 505:
      return "HTTP Version Not Supported";
    default:
      return status < 400 ? "OK" : status < 500 ? "Bad Request" : "Internal Server Error";
  }
}

}  // namespace mini_decoder::serving
