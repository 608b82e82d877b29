// Throw-away PKI for TLS tests, made with the openssl command-line tool in a per-process
// directory: a CA, a second (untrusted) CA, a server certificate for "normgrad.test" and a
// client certificate, both signed by the CA.
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"

namespace normgrad::testing {

class TestCertificates {
 public:
  // `dir` is created (replaced when it exists); ok() says whether openssl made everything.
  explicit TestCertificates(const std::string& parent)
      : dir_(absl::StrCat(parent, "/normgrad_test_pki_", getpid())) {
    const std::string script = absl::StrCat(
        "set -e; rm -rf '", dir_, "'; mkdir -p '", dir_, "'; cd '", dir_, "';",
        "openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.pem -days 2 "
        "-subj /CN=normgrad-test-ca;",
        "openssl req -x509 -newkey rsa:2048 -nodes -keyout other_ca.key -out other_ca.pem "
        "-days 2 -subj /CN=other-ca;",
        "printf 'subjectAltName=DNS:normgrad.test\\n' > server.ext;",
        "openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr "
        "-subj /CN=normgrad.test;",
        "openssl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
        "-out server.pem -days 2 -extfile server.ext;",
        "openssl req -newkey rsa:2048 -nodes -keyout client.key -out client.csr -subj /CN=client;",
        "openssl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
        "-out client.pem -days 2");
    ok_ = std::system(absl::StrCat("sh -c \"", script, "\" > /dev/null 2>&1").c_str()) == 0;
  }
  ~TestCertificates() { std::system(absl::StrCat("rm -rf '", dir_, "'").c_str()); }

  bool ok() const { return ok_; }
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  std::string Pem(const std::string& name) const {
    std::ifstream in(Path(name));
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }

 private:
  std::string dir_;
  bool ok_ = false;
};

}  // namespace normgrad::testing
