// frugal's entry point: the command line is cli::run (cli.cpp), so a test server can run it too
// (tests/support/frugal_server.cpp).
#include "commands.h"

int main(int argc, char** argv) { return frugal::cli::run(argc, argv); }
