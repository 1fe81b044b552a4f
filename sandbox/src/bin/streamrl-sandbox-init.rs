//! The process that sets up one sandbox (namespaces, file system) and then runs the
//! commands the host sends it. Started by [`streamrl_sandbox::Pool`]; not for direct use.

fn main() {
    streamrl_sandbox::init::main()
}
